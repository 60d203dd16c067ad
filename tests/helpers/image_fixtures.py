"""Images in the awkward forms ImageNet really holds under ``*.JPEG`` names: greyscale and CMYK JPEGs,
progressive JPEGs, and files that are really PNG or GIF. Each is one solid colour, so the colour any
decode, crop or resize must give is known without decoding: ``expected_rgb`` and ``expected_grey``
compute it from the colour the file was made from, by the published conversion formulas."""

import io

from PIL import Image

SIZE = (64, 48)  # large enough for a reduced (draft) decode of an 8-pixel crop


def _encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def cmyk_to_rgb(c: int, m: int, y: int, k: int) -> tuple[float, float, float]:
    """The naive CMYK -> RGB of libjpeg-based readers: ``R = (255 - C)(255 - K) / 255``, ..."""
    return tuple((255 - v) * (255 - k) / 255 for v in (c, m, y))


def rgb_to_grey(rgb) -> float:
    """ITU-R BT.601 luma, what a greyscale decode of a colour image gives: ``0.299 R + 0.587 G + 0.114 B``."""
    r, g, b = rgb
    return 0.299 * r + 0.587 * g + 0.114 * b


# name -> (the file's bytes, the colour it was made from as RGB, decode tolerance per channel)
AWKWARD = {
    "greyscale JPEG": (_encoded(Image.new("L", SIZE, 90), "JPEG"), (90, 90, 90), 2),
    "CMYK JPEG": (_encoded(Image.new("CMYK", SIZE, (200, 30, 60, 40)), "JPEG"), cmyk_to_rgb(200, 30, 60, 40), 3),
    "progressive JPEG": (_encoded(Image.new("RGB", SIZE, (20, 120, 200)), "JPEG", progressive=True), (20, 120, 200), 3),
    "PNG named .JPEG": (_encoded(Image.new("RGB", SIZE, (200, 30, 60)), "PNG"), (200, 30, 60), 0),
    "GIF named .JPEG": (_encoded(Image.new("RGB", SIZE, (10, 200, 30)).quantize(4), "GIF"), (10, 200, 30), 0),
}


def check_formats() -> None:
    """The fixtures are what they claim to be (read by Pillow, not by the code under test)."""
    kinds = {name: Image.open(io.BytesIO(data)) for name, (data, _, _) in AWKWARD.items()}
    assert (kinds["greyscale JPEG"].format, kinds["greyscale JPEG"].mode) == ("JPEG", "L")
    assert (kinds["CMYK JPEG"].format, kinds["CMYK JPEG"].mode) == ("JPEG", "CMYK")
    assert kinds["progressive JPEG"].format == "JPEG" and kinds["progressive JPEG"].info.get("progressive")
    assert kinds["PNG named .JPEG"].format == "PNG" and kinds["GIF named .JPEG"].format == "GIF"
    assert kinds["GIF named .JPEG"].mode == "P"
