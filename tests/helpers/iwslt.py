"""A tiny raw IWSLT14 release in the real format: the data, CLI and tokeniser tests share it."""

from __future__ import annotations

import random

from sacremoses import MosesTokenizer

from mmlight.data.prepare.iwslt import RAW_TEST_SETS

SUBJECTS = [
    ("der Hund", "the dog"),
    ("die Katze", "the cat"),
    ("mein Vater", "my father"),
    ("unsere Lehrerin", "our teacher"),
    ("das Kind", "the child"),
    ("ein Wissenschaftler", "a scientist"),
]


VERBS = [
    ("sieht", "sees"),
    ("liebt", "loves"),
    ("findet", "finds"),
    ("beobachtet", "watches"),
    ("versteht", "understands"),
]


OBJECTS = [
    ("den Garten", "the garden"),
    ("die Sonne", "the sun"),
    ("das Wasser", "the water"),
    ("den Computer", "the computer"),
    ("die Zukunft", "the future"),
    ("die Musik", "the music"),
]


ENDS = [(".", "."), ("!", "!"), (" heute.", " today."), (" nicht.", " not."), (", oder?", ", doesn't it?")]


def _sentences(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        (sd, se), (vd, ve), (od, oe), (ed, ee) = (rng.choice(x) for x in (SUBJECTS, VERBS, OBJECTS, ENDS))
        out.append((f"{sd[0].upper()}{sd[1:]} {vd} {od}{ed}", f"{se[0].upper()}{se[1:]} {ve} {oe}{ee}"))
    return out


def moses_tok(text: str, lang: str) -> str:
    return MosesTokenizer(lang=lang).tokenize(text, escape=True, return_str=True).lower()


def write_raw(root):
    """A tiny raw IWSLT14 release; returns the pairs expected after extraction+cleaning, in order."""
    root.mkdir(parents=True, exist_ok=True)
    pairs = _sentences(60)
    de, en, kept = [], [], []
    for talk in range(2):
        de += [
            f"<url>http://www.ted.com/talks/{talk}.html</url>",
            "<keywords>talks, science</keywords>",
            f"<talkid>{talk}</talkid>",
            f"<title>Anna Weber: Über Hunde {talk}</title>",
            "<description>Sie spricht über Hunde.</description>",
        ]
        en += [
            f"<url>http://www.ted.com/talks/{talk}.html</url>",
            "<keywords>talks, science</keywords>",
            f"<talkid>{talk}</talkid>",
            f"<title>Anna Weber: About dogs {talk}</title>",
            "<description>She talks about dogs.</description>",
        ]
        kept += [
            (f"Anna Weber: Über Hunde {talk}", f"Anna Weber: About dogs {talk}"),
            ("Sie spricht über Hunde.", "She talks about dogs."),
        ]
        for d, e in pairs[talk * 30 : (talk + 1) * 30]:
            de.append(d)
            en.append(e)
            kept.append((d, e))
    de_b = [line.encode() for line in de]
    en_b = [line.encode() for line in en]
    # bad pairs: an empty English side (line 10), invalid UTF-8 in German (line 20),
    # a pair with a length ratio over 1.5 and one over 175 tokens (both cleaned out)
    de_b.insert(9, b"Das ist leer.")
    en_b.insert(9, b"")
    de_b.insert(19, b"Kaputt \xff\xfe Text.")
    en_b.insert(19, b"Broken text.")
    de_b.insert(30, b"Ja .")
    en_b.insert(30, b"Yes , yes , yes , yes , yes .")
    de_b.insert(40, " ".join(["Wort"] * 180).encode())
    en_b.insert(40, " ".join(["word"] * 180).encode())
    (root / "train.tags.de-en.de").write_bytes(b"\n".join(de_b) + b"\n")
    (root / "train.tags.de-en.en").write_bytes(b"\n".join(en_b) + b"\n")

    test = []
    tests = _sentences(10, seed=1)
    tests[0] = ("Der Hund sieht die Sonne, oder?", "The dog sees the sun, doesn't it?")  # ’ in the XML
    for k, name in enumerate(RAW_TEST_SETS):
        for lang, side in (("de", 0), ("en", 1)):
            segs = tests[2 * k : 2 * k + 2]
            lines = [
                '<?xml version="1.0" encoding="UTF-8"?>',
                "<mteval>",
                f'<srcset setid="{name}" srclang="{lang}">',
                '<doc docid="1" genre="lectures">',
                f"<talkid>{k}</talkid>",
                "<title>Ein Titel</title>",
            ]
            lines += [f'<seg id="{i + 1}"> {s[side].replace(chr(39), chr(8217))} </seg>' for i, s in enumerate(segs)]
            lines += ["</doc>", "</srcset>", "</mteval>"]
            (root / f"{name}.de-en.{lang}.xml").write_text("\n".join(lines) + "\n", encoding="utf-8")
        test += tests[2 * k : 2 * k + 2]
    return kept, test
