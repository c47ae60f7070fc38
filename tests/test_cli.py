"""Our parser takes every mlx_lm.server 0.32.2 flag with its name, type and default."""

import argparse
import subprocess
import sys

import mlx_lm.server as upstream
import pytest

from mlx_lm_plus.config import parse_args
from mlx_lm_plus.config.flags import OUR_FLAGS, build_parser


def upstream_parser() -> argparse.ArgumentParser:
    """Upstream builds its parser inside main(): catch it at parse_args."""
    captured = {}

    class Captured(Exception):
        pass

    def capture(self, *args, **kwargs):
        captured["parser"] = self
        raise Captured

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture
    try:
        with pytest.raises(Captured):
            upstream.main()
    finally:
        argparse.ArgumentParser.parse_args = original
    return captured["parser"]


def describe(parser):
    out = {}
    for action in parser._actions:
        if action.dest == "help":
            continue
        kind = action.type if action.type in (int, float, str, None) else "callable"
        out[action.dest] = (
            tuple(action.option_strings),
            action.default,
            kind,
            tuple(action.choices) if action.choices else None,
            type(action).__name__,
            action.required,
        )
    return out


def test_every_upstream_flag_same_name_type_default():
    ours, theirs = describe(build_parser()), describe(upstream_parser())
    assert len(theirs) == 26  # the flags of 0.32.2
    for dest, spec in theirs.items():
        assert ours.get(dest) == spec, dest
    extra = {flag for spec in ours.values() for flag in spec[0]} - {
        flag for spec in theirs.values() for flag in spec[0]
    }
    assert extra == set(OUR_FLAGS)


def test_the_config_has_a_typed_field_for_every_flag_with_its_default(monkeypatch):
    """config.Config: one field per flag (and `models`, every --model), with
    the parser's default, so a Config built in code is the server's with no
    flags; and the field's type is the flag's."""
    import dataclasses
    import typing

    from mlx_lm_plus.config import Config

    # (--api-key's default is the environment's MLX_LM_PLUS_API_KEY.)
    monkeypatch.delenv("MLX_LM_PLUS_API_KEY", raising=False)

    parser = build_parser()
    dests = {a.dest: a for a in parser._actions if a.dest != "help"}
    fields = {f.name: f for f in dataclasses.fields(Config)}
    assert set(fields) == set(dests) | {"models"}
    assert parse_args([]) == Config()
    hints = typing.get_type_hints(Config)

    def runtime_types(hint):  # (Optional[X] -> (X, None), Dict[str, Any] -> (dict,))
        if typing.get_origin(hint) is typing.Union:
            return tuple(typing.get_origin(a) or a for a in typing.get_args(hint))
        return (typing.get_origin(hint) or hint,)

    for dest, action in dests.items():
        kind = hints[dest]
        allowed = runtime_types(kind)
        numbers = (int, float) if float in allowed else ()
        if action.default is not None and action.type in (int, float, str, None):
            assert isinstance(action.default, allowed + numbers), dest
        if action.type in (int, float, str):
            assert action.type in allowed, dest
        if isinstance(action, (argparse._StoreTrueAction,)):
            assert kind is bool, dest
    # The flags with a converter of their own.
    typed = parse_args(["--prompt-cache-bytes", "1GB", "--chat-template-args", '{"a": 1}',
                        "--allowed-origins", "http://a,http://b"])
    for dest in ("prompt_cache_bytes", "chat_template_args", "allowed_origins",
                 "responses_store_bytes"):
        assert isinstance(getattr(typed, dest), runtime_types(hints[dest])), dest


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--model", "m", "--port", "9000", "--allowed-origins", "http://a,http://b"],
        ["--temp", "0.7", "--top-k", "20", "--prompt-cache-bytes", "2GB"],
        ["--chat-template-args", '{"enable_thinking": false}', "--kv-bits", "4"],
    ],
)
def test_same_values_as_upstream(argv):
    ours = vars(parse_args(argv))
    for flag in OUR_FLAGS:
        ours.pop(flag.lstrip("-").replace("-", "_"))
    assert ours.pop("models") == ([ours["model"]] if ours["model"] else [])
    theirs = vars(upstream_parser().parse_args(argv))
    if isinstance(theirs["allowed_origins"], str):
        theirs["allowed_origins"] = theirs["allowed_origins"].split(",")
    assert ours == theirs


def test_launch_forms_print_help():
    for cmd in (
        [sys.executable, "-m", "mlx_lm_plus.server", "--help"],
        [sys.executable, "-m", "mlx_lm_plus", "server", "--help"],
    ):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "--prompt-cache-bytes" in out.stdout


@pytest.mark.parametrize("argv", [["--kv-bits", "7"], ["--kv-bits", "4", "--kv-group-size", "48"]])
def test_kv_bits_that_mlx_cannot_quantize_with_fail_at_startup(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "--kv-bits" in capsys.readouterr().err
    assert parse_args(["--kv-bits", "4", "--kv-group-size", "32"]).kv_bits == 4


def test_model_repeated_serves_each_first_is_default(tmp_path, capsys):
    args = parse_args(["--model", "a", "--port", "9", "--model=b", "--model", "c"])
    assert (args.model, args.models, args.port) == ("a", ["a", "b", "c"], 9)
    bad = tmp_path / "models.json"
    bad.write_text('{"models": [{"path": "x", "ttl": -1}]}')
    for argv in (["--models-config", str(bad)], ["--models-dir", str(tmp_path / "none")],
                 ["--max-loaded-models", "0"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    assert "ttl" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--prompt-cache-bytes", "--prompt-cache-disk-bytes"])
@pytest.mark.parametrize("size", ["200KB", "1TB", "-5", "lots"])
def test_a_size_mlx_lm_cannot_read_is_a_usage_error(flag, size, capsys):
    """mlx-lm's _parse_size raises KeyError or InvalidOperation, which
    argparse lets out as a traceback (upstream too): a usage error here."""
    argv = [flag, size] + (["--prompt-cache-dir", "/nonexistent"] if "disk" in flag else [])
    with pytest.raises(SystemExit) as exit:
        parse_args(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag}: invalid size '{size}'" in err and "Traceback" not in err
    assert parse_args([flag, "512M"] + argv[2:]).__dict__[flag[2:].replace("-", "_")] == 512 * 10**6
