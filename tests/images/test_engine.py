"""The engine's helpers on plain processes: a failed command says what it printed."""

from __future__ import annotations

import os
import sys

import pytest

from tests.images.engine import checked

pytestmark = pytest.mark.images


def test_a_failed_command_raises_with_the_tail_of_its_stderr() -> None:
    argv = [sys.executable, "-c", "import sys; sys.exit('x' * 5000 + ' no bookworm source')"]
    with pytest.raises(RuntimeError, match=r"exited 1: x+ no bookworm source$") as raised:
        checked(argv, dict(os.environ), 30)
    assert len(str(raised.value)) < 2100
