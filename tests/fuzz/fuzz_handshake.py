"""Coverage-guided fuzzing of the handshake parser (by hand):

pip install atheris && python tests/fuzz/fuzz_handshake.py -max_total_time=60
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

with atheris.instrument_imports():
    from tests.fuzz.targets import handshake_target


def one(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    chunks = [fdp.ConsumeIntInRange(1, 64) for _ in range(fdp.ConsumeIntInRange(0, 8))]
    handshake_target(fdp.ConsumeBytes(fdp.remaining_bytes()), chunks)


if __name__ == "__main__":
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()
