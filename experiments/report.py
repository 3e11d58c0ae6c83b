"""What every experiment script does with its result: print the markdown, and write it to --out."""

from __future__ import annotations


def interleaved(engines: dict, repeats: int, run) -> dict:
    """run(engine, r) for each engine in rounds r = 0 .. repeats - 1, the engines in their order in
    even rounds and reversed in odd ones, so that a shared machine's drift falls on all of them
    alike; returns each key's results in round order (pairs across keys: the same round)."""
    runs = {key: [] for key in engines}
    for r in range(repeats):
        for key in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            runs[key].append(run(engines[key], r))
    return runs


def publish(lines: list[str], out: str | None) -> str:
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
    return text
