"""What every experiment script does with its result: print the markdown, and write it to --out."""

from __future__ import annotations


def publish(lines: list[str], out: str | None) -> str:
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
    return text
