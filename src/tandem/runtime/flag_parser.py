"""Where every flag of every `tandem` command gets its value: one generic pass over the parser.

    command line  >  environment (TANDEM_<FLAG>)  >  config file (--config FILE.yaml)  >  default

- The environment variable of a flag is derived from its first long option:
  `--http-port` ↔ `TANDEM_HTTP_PORT`, `--kv-overlap-weight` ↔ `TANDEM_KV_OVERLAP_WEIGHT`.
  Booleans take 1/0, true/false, yes/no, on/off; repeatable flags (`--api-key`) a comma-separated
  list; multi-value flags (`nargs`) a space-separated one. An empty variable counts as unset.
- The config file (`--config FILE`, or `TANDEM_CONFIG`) is a YAML mapping of flag names (dashes or
  underscores) to values. A top-level key that names a command (`serve:`, `frontend:`,
  `worker:`, ...) and holds a mapping is a section read only by that command; its keys override
  the top-level ones (`router: kv` is the flag `--router`, `router: {...}` the section). So
  one file can serve a whole deployment: shared flags (namespace, discovery, events) at the
  top, each command's own in its section. A key the command does not know is an error
  naming the key and the file.
- `--help` shows every flag's default and its variable. A bad value (wrong type, not one of the
  choices, bad YAML) stops the command at start with a message naming the flag and the source.

Applied by each entry point in one place: `parse_args(parser, argv)` instead of
`parser.parse_args(argv)`; flags added to a parser later get all of this without more code.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.errors import ConfigError

logger = logging.getLogger(__name__)

ENV_PREFIX = "TANDEM_"
CONFIG_FLAG = "--config"
CONFIG_ENV = "TANDEM_CONFIG"
# the commands whose names are section keys in a config file (tandem.cli.main.COMMANDS)
SECTIONS = frozenset(
    {"serve", "frontend", "worker", "router", "planner", "profile", "global-router", "bench"}
)
# variables read before the names were derived from the flags: old name -> the flag's variable
DEPRECATED_ENV: dict[str, str] = {
    "TANDEM_HOST_IP": "TANDEM_HOST",
    "TANDEM_PLANNER_MODE": "TANDEM_MODE",
    "TANDEM_PLANNER_TTFT_TARGET_MS": "TANDEM_TTFT_TARGET_MS",
    "TANDEM_PLANNER_ITL_TARGET_MS": "TANDEM_ITL_TARGET_MS",
    "TANDEM_PLANNER_INTERVAL_S": "TANDEM_INTERVAL_S",
    "TANDEM_PLANNER_COOLDOWN_UP_S": "TANDEM_COOLDOWN_UP_S",
    "TANDEM_PLANNER_COOLDOWN_DOWN_S": "TANDEM_COOLDOWN_DOWN_S",
    "TANDEM_PLANNER_READY_TIMEOUT_S": "TANDEM_READY_TIMEOUT_S",
    "TANDEM_PLANNER_DRAIN_TIMEOUT_S": "TANDEM_DRAIN_TIMEOUT_S",
    "TANDEM_PLANNER_MARGIN": "TANDEM_SCALE_DOWN_MARGIN",
    "TANDEM_PLANNER_MAX_TOTAL_WORKERS": "TANDEM_MAX_TOTAL_WORKERS",
    "TANDEM_PLANNER_PREDICTOR": "TANDEM_PREDICTOR",
    "TANDEM_PLANNER_PROFILE": "TANDEM_PROFILE",
    "TANDEM_PLANNER_CONNECTOR": "TANDEM_CONNECTOR",
    "TANDEM_PLANNER_WORKER_ARGS": "TANDEM_WORKER_ARGS",
    "TANDEM_PLANNER_WORKER_DRAIN_GRACE_S": "TANDEM_WORKER_DRAIN_GRACE_S",
    "TANDEM_PLANNER_WORKER_LOG_DIR": "TANDEM_WORKER_LOG_DIR",
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_NO_VALUE = (argparse._HelpAction, argparse._VersionAction)


@dataclass(frozen=True, slots=True)
class Source:
    """Where a value came from, as an error message names it."""

    kind: str  # "env" | "config"
    where: str  # the variable, or "FILE (section S)"

    def describe(self, flag: str) -> str:
        if self.kind == "env":
            return f"{flag} (from env {self.where})"
        return f"{flag} (from config file {self.where})"


def env_name(action: argparse.Action) -> str:
    """`TANDEM_<FLAG>` of the action's first long option (`--http-port` → TANDEM_HTTP_PORT)."""
    return ENV_PREFIX + primary_flag(action)[2:].replace("-", "_").upper()


def primary_flag(action: argparse.Action) -> str:
    longs = [s for s in action.option_strings if s.startswith("--")]
    return (longs or action.option_strings)[0]


def configurable_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's flags that take a value from env or config (not -h, not --config, not
    internal ones hidden from --help, such as serve's --frontend-replica)."""
    return [
        a
        for a in parser._actions
        if a.option_strings
        and not isinstance(a, _NO_VALUE)
        and a.dest != argparse.SUPPRESS
        and a.help != argparse.SUPPRESS
        and CONFIG_FLAG not in a.option_strings
    ]


def _command(parser: argparse.ArgumentParser) -> str:
    parts = parser.prog.split()
    return parts[1] if len(parts) > 1 else parts[0]


def _is_bool(action: argparse.Action) -> bool:
    return isinstance(
        action,
        argparse._StoreTrueAction | argparse._StoreFalseAction | argparse.BooleanOptionalAction,
    )


def _is_list(action: argparse.Action) -> bool:
    return (
        isinstance(action, argparse._AppendAction)
        or action.nargs in ("*", "+")
        or (isinstance(action.nargs, int) and action.nargs > 1)
    )


def _convert_one(action: argparse.Action, raw: Any) -> Any:
    if isinstance(raw, Mapping | list):
        raise ConfigError(f"expected a single value, got {raw!r}")
    value = raw
    if action.type is not None:
        kind = getattr(action.type, "__name__", repr(action.type))
        try:
            value = action.type(raw if isinstance(raw, str) else str(raw))  # type: ignore[operator]
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            detail = str(exc) if isinstance(exc, argparse.ArgumentTypeError) else ""
            suffix = f": {detail}" if detail else ""
            raise ConfigError(f"invalid {kind} value {raw!r}{suffix}") from None
    elif not isinstance(raw, str):
        value = str(raw)
    if action.choices is not None and value not in action.choices:
        expected = ", ".join(map(str, action.choices))
        raise ConfigError(f"invalid choice {raw!r}; expected one of: {expected}")
    return value


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"invalid boolean {raw!r}; expected one of: {', '.join(_TRUE + _FALSE)}")


def convert(action: argparse.Action, raw: Any, *, from_env: bool) -> Any:
    """`raw` (a string from the environment, a YAML value from a config file) as the value the
    flag would have had on the command line; raises ConfigError saying what was expected."""
    if _is_bool(action):
        value = _bool(raw)
        return (not value) if isinstance(action, argparse._StoreFalseAction) else value
    if _is_list(action):
        if from_env:
            text = str(raw)
            items: list[Any] = (
                [s.strip() for s in text.split(",") if s.strip()]
                if isinstance(action, argparse._AppendAction)
                else shlex.split(text)
            )
        else:
            items = list(raw) if isinstance(raw, list) else [raw]
        if isinstance(action, argparse._AppendAction) and action.nargs not in (None, "?"):
            return [[_convert_one(action, i) for i in _as_list(item)] for item in items]
        return [_convert_one(action, item) for item in items]
    if isinstance(action, argparse._StoreConstAction | argparse._CountAction):
        return action.const if _bool(raw) else action.default
    return _convert_one(action, raw)


def _as_list(item: Any) -> list[Any]:
    return list(item) if isinstance(item, list) else shlex.split(str(item))


def _normalise(key: object) -> str:
    return str(key).strip().lstrip("-").replace("_", "-").lower()


def _flag_index(actions: Sequence[argparse.Action]) -> dict[str, argparse.Action]:
    """Every long option (without its dashes) → its action."""
    index: dict[str, argparse.Action] = {}
    for action in actions:
        for option in action.option_strings:
            if option.startswith("--"):
                index[_normalise(option)] = action
    return index


def load_config_file(path: str, command: str) -> dict[str, Any]:
    """The flat key → value mapping `command` reads from the YAML file at `path`: the top-level
    flag keys, overridden by the command's own section. Raises ConfigError on a bad file."""
    data = _read_yaml(path)
    # a command's name with a mapping is its section (`router:` is also the flag `--router`)
    values = {k: v for k, v in data.items() if not _is_section(k, v)}
    values.update(config_section(path, command, data))
    return values


def config_section(path: str, command: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """Only the `command:` section of the file (empty when it has none)."""
    data = _read_yaml(path) if data is None else data
    section: dict[str, Any] = {}
    for key, value in data.items():
        if _is_section(key, value) and _normalise(key) == command:
            section.update(value)
    return section


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of flag names to values")
    return data


def _is_section(key: object, value: object) -> bool:
    return _normalise(key) in SECTIONS and isinstance(value, dict)


def _config_path(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == CONFIG_FLAG and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(CONFIG_FLAG + "="):
            return arg.split("=", 1)[1]
    return environ.get(CONFIG_ENV) or None


def _help_suffix(action: argparse.Action) -> str:
    default = action.default
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        shown = "on" if default else "off"
    elif default is None or default == argparse.SUPPRESS or default in ([], ()):
        shown = "none"
    elif default == "":
        shown = "''"
    else:
        shown = str(default)
    return f" [default: {shown}; env {env_name(action)}]".replace("%", "%%")


def annotate(parser: argparse.ArgumentParser) -> None:
    """Add `--config` (unless the command has its own) and append each flag's default and
    environment variable to its help. Idempotent."""
    if getattr(parser, "_tandem_annotated", False):
        return
    parser._tandem_annotated = True  # type: ignore[attr-defined]
    if not any(CONFIG_FLAG in a.option_strings for a in parser._actions):
        parser._tandem_config_file = True  # type: ignore[attr-defined]
        parser.add_argument(
            CONFIG_FLAG,
            metavar="FILE",
            help="YAML file of flag values (top-level keys, and a section per command such as "
            f"'{_command(parser)}:'); command line > env > this file > defaults [env {CONFIG_ENV}]",
        )
    for action in configurable_actions(parser):
        help_ = (action.help or "").replace(" (default: %(default)s)", "")
        action.help = help_ + _help_suffix(action)


def _warn_env(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment with deprecated names mapped onto the derived ones (warned once each),
    and a warning for a variable named after a flag's alias, which is not read."""
    env = dict(environ)
    for old, new in DEPRECATED_ENV.items():
        if environ.get(old) and not environ.get(new):
            logger.warning("env %s is deprecated; set %s instead", old, new)
            env[new] = environ[old]
    for action in configurable_actions(parser):
        for option in action.option_strings[1:]:
            alias = ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()
            if option.startswith("--") and alias != env_name(action) and environ.get(alias):
                logger.warning(
                    "env %s is not read; the variable of %s is %s",
                    alias,
                    "/".join(action.option_strings),
                    env_name(action),
                )
    return env


def _given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """Dests the command line sets: a parse with every default suppressed."""
    saved = [(a, a.default, a.required) for a in parser._actions]
    saved_defaults, parser._defaults = parser._defaults, {}
    try:
        for action in parser._actions:
            if not isinstance(action, _NO_VALUE):
                action.default, action.required = argparse.SUPPRESS, False
        ns, _ = parser.parse_known_args(list(argv))
    finally:
        for action, default, required in saved:
            action.default, action.required = default, required
        parser._defaults = saved_defaults
    return set(vars(ns))


def resolve_defaults(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    environ: Mapping[str, str] | None = None,
) -> None:
    """Set each flag's default to its env value, else its config-file value, so that argparse
    then lets the command line win. Raises ConfigError naming the flag and the source."""
    environ = os.environ if environ is None else environ
    actions = configurable_actions(parser)
    env = _warn_env(parser, environ)
    path = _config_path(argv, environ)
    command = _command(parser)
    config: dict[str, Any] = {}
    if path is not None and getattr(parser, "_tandem_config_file", False):
        config = load_config_file(path, command)
    index = _flag_index(actions)
    by_action: dict[int, tuple[Any, Source]] = {}
    for key, raw in config.items():
        action = index.get(_normalise(key))
        if action is None:
            raise ConfigError(
                f"config file {path}: unknown key '{key}' for tandem {command} "
                f"(expected a flag name such as '{primary_flag(actions[0])[2:]}', or a section: "
                f"{', '.join(sorted(SECTIONS))})"
            )
        if raw is not None:  # `key:` / `key: null` leaves the flag at its default
            by_action[id(action)] = (raw, Source("config", f"{path}, key '{key}'"))
    for action in actions:
        var = env_name(action)
        if env.get(var, "") != "":
            by_action[id(action)] = (env[var], Source("env", var))
    given = _given_on_command_line(parser, argv) if by_action else set()
    for action in actions:
        if id(action) not in by_action or action.dest in given:
            continue
        raw, source = by_action[id(action)]
        try:
            value = convert(action, raw, from_env=source.kind == "env")
        except ConfigError as exc:
            raise ConfigError(f"{source.describe(primary_flag(action))}: {exc}") from None
        action.default = value
        action.required = False  # given by env or config, as a default cannot be
        if action.dest in parser._defaults:
            parser._defaults[action.dest] = value


def parse_args(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """`parser.parse_args(argv)` with env and config-file values; exits 2 on a bad value."""
    args, rest = parse_known_args(parser, argv, environ)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def parse_known_args(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    annotate(parser)
    try:
        resolve_defaults(parser, argv, environ)
    except ConfigError as exc:
        parser.error(str(exc))
    args, rest = parser.parse_known_args(argv)
    _check_tracing(parser, args)
    return args, rest


def _check_tracing(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An OTLP endpoint (flag, env or config file) needs the tracing extra: without it the
    command exits here, naming the extra, not at its first span with an import traceback."""
    endpoint = getattr(args, "otlp_endpoint", "")
    if not endpoint:
        return
    from tandem.runtime.tracing import INSTALL_HINT, missing_extra

    why = missing_extra()
    if why is not None:
        parser.error(f"--otlp-endpoint {endpoint} needs the tracing extra ({why}): "
                     f"{INSTALL_HINT}")  # fmt: skip


def early_value(
    argv: Sequence[str], flag: str, command: str, default: str, environ: Mapping[str, str]
) -> str:
    """One flag's value before the parser exists (e.g. `--engine`, which decides the other
    flags): command line, then env, then the config file's, then `default`."""
    pre = argparse.ArgumentParser(prog=f"tandem {command}", add_help=False)
    pre.add_argument(flag, default=default)
    pre.add_argument(CONFIG_FLAG)
    known, _ = pre.parse_known_args(list(argv))
    dest = flag[2:].replace("-", "_")
    if (value := getattr(known, dest)) != default:
        return str(value)
    if environ.get(var := ENV_PREFIX + dest.upper()):
        return environ[var]
    path = _config_path(argv, environ)
    if path is not None:
        config = load_config_file(path, command)
        for key, raw in config.items():
            if _normalise(key) == _normalise(dest):
                return str(raw)
    return default
