"""replay.py: sealed reasoning opens only as it was sealed, in this process."""

import subprocess
import sys

from hypothesis import given, strategies as st

from mlx_lm_plus.replay import PREFIX, open_sealed, seal


@given(st.text())
def test_seal_opens_to_the_text(text):
    assert open_sealed(seal(text)) == text


def test_changed_or_foreign_values_do_not_open():
    sealed = seal("I should call the tool.")
    body, _, mac = sealed[len(PREFIX):].rpartition(".")
    other = seal("I should not.")[len(PREFIX):].rpartition(".")[0]
    for value in (PREFIX + other + "." + mac,  # another text, this mac
                  sealed[:-2], sealed + "A", PREFIX + body, PREFIX, "", None, 5, b"x",
                  PREFIX + "%%%." + mac, sealed.replace(PREFIX, "mlxp2.")):
        assert open_sealed(value) is None, value
    # Another process (another key) can't open it either.
    code = f"from mlx_lm_plus.replay import open_sealed; print(open_sealed({sealed!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "None", out.stderr
