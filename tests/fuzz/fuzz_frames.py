"""Coverage-guided fuzzing of the frame scanner (by hand):

pip install atheris && python tests/fuzz/fuzz_frames.py -max_total_time=60
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

with atheris.instrument_imports():
    from tests.fuzz.targets import scanner_target


def one(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    masked = fdp.ConsumeBool()
    chunks = [fdp.ConsumeIntInRange(1, 64) for _ in range(fdp.ConsumeIntInRange(0, 12))]
    scanner_target(fdp.ConsumeBytes(fdp.remaining_bytes()), chunks, masked)


if __name__ == "__main__":
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()
