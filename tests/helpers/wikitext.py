"""A tiny raw WikiText-103 in the real format: the data, text and language-model tests share it."""

from __future__ import annotations

# The real raw format: every line starts with a space, "empty" lines hold one space, headings are
# " = Title = ", and the text is pre-tokenised (`@-@`, `<unk>`, punctuation as words).
TRAIN = (
    b" \n"
    b" = Valkyria = \n"
    b" \n"
    b" The game @-@ play is <unk> . The <unk> game is fun . \n"
    b"\xff\xfe bad \xc3 line \n"  # line 5: not UTF-8
    b" = = Gameplay = = \n"
    b" The play , the game . \n"
)


VALID = b" \n = Valkyria = \n The zebra game . \n"  # "zebra" is not in the training vocabulary


TEST = b" = Gameplay = \n \n fun is the play , <unk> . \n The game"  # no final newline


def write_raw(src, files=None):
    """Write the raw files into ``src`` (made if missing) and return it.

    Args:
        src: the raw data folder.
        files: file name -> bytes; by default the three splits ``TRAIN``, ``VALID`` and ``TEST``.
    """
    src.mkdir(parents=True, exist_ok=True)
    for name, data in (
        files or {"wiki.train.tokens": TRAIN, "wiki.valid.tokens": VALID, "wiki.test.tokens": TEST}
    ).items():
        (src / name).write_bytes(data)
    return src


def tokens(data: bytes) -> list[str]:
    """The reference tokenisation, written independently: every good line + "</s>"."""
    out = []
    for raw in data.split(b"\n")[: None if not data.endswith(b"\n") else -1]:
        try:
            out += raw.decode("utf-8").split() + ["</s>"]
        except UnicodeDecodeError:
            pass
    return out
