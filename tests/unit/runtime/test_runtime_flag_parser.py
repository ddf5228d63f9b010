"""tandem.runtime.flag_parser: every flag of every command from the command line, TANDEM_<FLAG>
env or a YAML config file, in that order; help shows default and variable; bad values stop the
start."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.runtime import flag_parser
from tandem.runtime.flag_parser import annotate, configurable_actions, env_name, parse_args


def _serve() -> argparse.ArgumentParser:
    from tandem.cli.serve import build_parser

    return build_parser()


def _command(name: str, module: str) -> Callable[[], argparse.ArgumentParser]:
    def build() -> argparse.ArgumentParser:
        import importlib

        parser = argparse.ArgumentParser(prog=f"tandem {name}")
        importlib.import_module(module).add_arguments(parser)
        return parser

    return build


def _worker(engine: str) -> Callable[[], argparse.ArgumentParser]:
    def build() -> argparse.ArgumentParser:
        from tandem.cli.worker import add_arguments

        parser = argparse.ArgumentParser(prog="tandem worker")
        add_arguments(parser, ["--engine", engine])
        return parser

    return build


def _profile() -> argparse.ArgumentParser:
    from tandem.cli.profile import build_parser

    return build_parser(["--engine", "mocker"])


def _bench() -> argparse.ArgumentParser:
    from tandem.cli.bench import build_load_parser

    return build_load_parser()


PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "serve": _serve,
    "frontend": _command("frontend", "tandem.frontend.main"),
    "worker-mocker": _worker("mocker"),
    "worker-native": _worker("native"),
    "worker-encoder": _worker("encoder"),
    "router": _command("router", "tandem.cli.router"),
    "planner": _command("planner", "tandem.cli.planner"),
    "global-router": _command("global-router", "tandem.cli.global_router"),
    "profile": _profile,
    "bench": _bench,
}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_flag_has_help_and_a_unique_derived_env_variable(name: str) -> None:
    parser = PARSERS[name]()
    annotate(parser)
    missing = [a.option_strings for a in configurable_actions(parser) if not a.help]
    assert not missing, f"tandem {name}: flags without help text: {missing}"
    names = [env_name(a) for a in configurable_actions(parser)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    text = parser.format_help()
    for action in configurable_actions(parser):
        assert env_name(action) in text.replace("\n", " ").replace("  ", ""), action
    assert "[default: " in text


def _frontend() -> argparse.ArgumentParser:
    return PARSERS["frontend"]()


def test_help_names_the_variable_of_the_http_port() -> None:
    parser = _frontend()
    annotate(parser)
    help_ = " ".join(parser.format_help().split())
    assert "--http-port PORT, --port PORT HTTP port [default: 8000; env TANDEM_HTTP_PORT]" in help_


def test_precedence_command_line_env_config_default(tmp_path: Path) -> None:
    config = tmp_path / "tandem.yaml"
    config.write_text(
        "http_port: 9001\nmigration-limit: 2\nrouter: kv\nfrontend:\n  router: random\n"
    )
    env = {"TANDEM_HTTP_PORT": "9002"}
    args = parse_args(_frontend(), ["--config", str(config)], env)
    assert (args.port, args.migration_limit, args.router) == (9002, 2, "random")
    assert args.max_fanout == 128  # default
    args = parse_args(_frontend(), ["--config", str(config), "--port", "9003"], env)
    assert args.port == 9003
    args = parse_args(_frontend(), [], {"TANDEM_CONFIG": str(config)})
    assert args.port == 9001  # the file named by TANDEM_CONFIG


def test_config_sections_of_other_commands_are_ignored(tmp_path: Path) -> None:
    config = tmp_path / "tandem.yaml"
    config.write_text("namespace: prod\nworker:\n  speedup-ratio: 0\nfrontend:\n  port: 1234\n")
    args = parse_args(_frontend(), ["--config", str(config)], {})
    assert (args.runtime_namespace, args.port) == ("prod", 1234)
    args = parse_args(PARSERS["worker-mocker"](), ["--config", str(config)], {})
    assert (args.runtime_namespace, args.speedup_ratio) == ("prod", 0.0)


def _error(
    parser: argparse.ArgumentParser,
    argv: list[str],
    env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(parser, argv, env)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_unknown_config_key_names_the_key_and_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tandem.yaml"
    config.write_text("prot: 8000\n")
    err = _error(_frontend(), ["--config", str(config)], {}, capsys)
    assert "unknown key 'prot'" in err and str(config) in err


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("port: eighty\n", "--http-port (from config file"),
        ("router: [kv]\n", "expected a single value"),
        ("disagg-flow: sideways\n", "invalid choice 'sideways'; expected one of"),
        ("port: [\n", "is not valid YAML"),
        ("- port\n", "expected a mapping of flag names"),
    ],
)
def test_bad_config_values_fail_naming_flag_and_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str
) -> None:
    config = tmp_path / "tandem.yaml"
    config.write_text(text)
    err = _error(_frontend(), ["--config", str(config)], {}, capsys)
    assert expected in err and str(config) in err


def test_missing_config_file_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(_frontend(), ["--config", str(tmp_path / "nope.yaml")], {}, capsys)
    assert "cannot read config file" in err


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"TANDEM_HTTP_PORT": "x"},
            "--http-port (from env TANDEM_HTTP_PORT): invalid int value 'x'",
        ),
        ({"TANDEM_DISCOVERY": "zookeeper"}, "--discovery (from env TANDEM_DISCOVERY): invalid"),
        ({"TANDEM_DISAGG": "maybe"}, "--disagg (from env TANDEM_DISAGG): invalid boolean"),
    ],
)
def test_bad_env_values_fail_naming_flag_and_variable(
    capsys: pytest.CaptureFixture[str], env: dict[str, str], expected: str
) -> None:
    assert expected in _error(_frontend(), [], env, capsys)


def test_a_bad_env_value_is_not_read_when_the_command_line_sets_the_flag() -> None:
    assert parse_args(_frontend(), ["--port", "81"], {"TANDEM_HTTP_PORT": "x"}).port == 81


def test_env_booleans_lists_and_empty_values() -> None:
    env = {
        "TANDEM_DISAGG": "yes",
        "TANDEM_NO_KV_EVENTS": "1",
        "TANDEM_API_KEY": "a, b",
        "TANDEM_MIGRATION_LIMIT": "",  # empty: unset
    }
    args = parse_args(_frontend(), [], env)
    assert (args.disagg, args.no_kv_events, args.api_key) == (True, True, ["a", "b"])
    assert args.migration_limit == 3  # the default: a lost worker loses no stream
    # a repeatable flag on the command line replaces the env list, it does not extend it
    assert parse_args(_frontend(), ["--api-key", "c"], env).api_key == ["c"]
    assert parse_args(_frontend(), ["--no-disagg"], env).disagg is False


def test_store_false_flag_from_env() -> None:
    parser = PARSERS["worker-mocker"]()
    assert (
        parse_args(parser, [], {"TANDEM_NO_MM_LOCAL_FALLBACK": "true"}).mm_local_fallback is False
    )


def test_config_gives_a_required_flag(tmp_path: Path) -> None:
    config = tmp_path / "p.yaml"
    config.write_text("profile:\n  output: out.json\n")
    assert parse_args(_profile(), ["--config", str(config)], {}).output == "out.json"


def test_deprecated_and_alias_variables_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=flag_parser.__name__):
        args = parse_args(PARSERS["worker-mocker"](), [], {"TANDEM_HOST_IP": "10.0.0.7"})
        assert args.runtime_host == "10.0.0.7"
        assert "TANDEM_HOST_IP is deprecated; set TANDEM_HOST" in caplog.text
        assert parse_args(_frontend(), [], {"TANDEM_PORT": "1"}).port == 8000
        assert "TANDEM_PORT is not read; the variable of --http-port/--port" in caplog.text


def test_engine_read_early_from_config(tmp_path: Path) -> None:
    from tandem.cli.worker import _engine_from_argv

    config = tmp_path / "w.yaml"
    config.write_text("worker:\n  engine: encoder\n")
    assert _engine_from_argv(["--config", str(config)]) == "encoder"


def test_global_router_keeps_its_own_config_flag(tmp_path: Path) -> None:
    args = parse_args(PARSERS["global-router"](), ["--config", "pools.json"], {"TANDEM_PORT": "9"})
    assert (args.config, args.port) == ("pools.json", 9)
