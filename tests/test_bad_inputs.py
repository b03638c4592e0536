"""The bad-input corpus (issue 16): every bad input gets one clear error and loses nothing.

Each case asserts the outcome (the exception type, or the exit status and that no traceback is
printed for a user mistake) and the message's key words. In-process where possible; the engine
API cases run in one worker process (tests/_bad_api_worker.py, one rank), and only the CLI and
example cases that must exit run as subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}

# ---------------------------------------------------------------------------------------------
# engine API misuse (one worker process, one rank)


@pytest.fixture(scope="module")
def api() -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests._bad_api_worker"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


#: case -> (expected "Type: message" prefix, key words in the message)
API_ERRORS: dict[str, tuple[str, tuple[str, ...]]] = {
    **{
        f"second_initialize_s{s}": (
            "ConfigError: initialize(model=...): this model already belongs to engine #",
            (
                f"ZeRO stage {s}",
                "_bad_api_worker.py:",
                "still live",
                "first engine losses fell: True",
            ),
        )
        for s in (0, 1, 2, 3)
    },
    "model_none": ("ConfigError: initialize(model=None)", ("torch.nn.Module",)),
    "model_callable": ("ConfigError: initialize(model=...)", ("got function", "wrap a function")),
    "model_string": ("ConfigError: initialize(model=...)", ("torch.nn.Module, got str",)),
    "model_frozen": ("ConfigError: initialize(model=...)", ("all 4 parameters", "frozen")),
    "model_no_params": ("ConfigError: initialize(model=...)", ("no parameters",)),
    **{
        f"destroyed_{call}": (
            f"EngineDestroyedError: {name}(): engine #",
            ("was destroyed", "build a new model"),
        )
        for call, name in (
            ("forward", "forward"),
            ("backward", "backward"),
            ("step", "step"),
            ("save_checkpoint", "save_checkpoint"),
            ("load_checkpoint", "load_checkpoint"),
            ("state_dict", "module_state_dict"),
        )
    },
    "destroyed_initialize_again": (
        "ConfigError: initialize(model=...): this model's parameters were emptied when engine #",
        ("was destroyed", "fresh model"),
    ),
    "loss_vector": ("ValueError: backward(loss): loss must be a scalar", ("(4, 1)", "mean()")),
    "loss_float": ("TypeError: backward(loss): loss must be a torch.Tensor", ("got float",)),
    "loss_detached": ("ValueError: backward(loss): loss does not require grad", ("detached",)),
    "loss_no_grad": ("ValueError: backward(loss): loss does not require grad", ("no_grad",)),
    "loss_other_model": ("RuntimeError: backward(loss): the loss reached none", ("forward",)),
    **{
        f"step_{kind}_s{s}": (
            "RuntimeError: step(): no engine.backward(loss) since the last update",
            ("call backward before each step",),
        )
        for kind in ("without_backward", "twice")
        for s in (0, 2)
    },
}

#: misuse-looking inputs that are fine: case -> the outcome
API_ACCEPTED = {
    "model_frozen_forward_only": "ok: (4, 1)",  # a forward-only engine needs no trainable params
    "one_element_loss_shape_1": "ok: backward ran",  # shape (1,) is a scalar to autograd
}


@pytest.mark.parametrize("case", sorted(API_ERRORS))
def test_api_misuse_is_one_clear_error(api: dict[str, Any], case: str) -> None:
    prefix, words = API_ERRORS[case]
    got = api[case]
    assert got.startswith(prefix), got
    for word in words:
        assert word in got, (word, got)


@pytest.mark.parametrize("case", sorted(API_ACCEPTED))
def test_api_input_accepted_correctly(api: dict[str, Any], case: str) -> None:
    assert api[case] == API_ACCEPTED[case]


def test_nan_loss_in_fp32_is_skipped_and_reported(api: dict[str, Any]) -> None:
    res = api["nan_loss_fp32"]
    assert res["skipped"] == 1 and res["finite"], res
    assert "step 3 skipped: non-finite gradient (inf or NaN)" in res["log"], res["log"]
    step4 = [line for line in res["log"] if line.startswith("step=4 ")]
    assert step4 and "skipped=1" in step4[0], res["log"]


# ---------------------------------------------------------------------------------------------
# config files: one loader for initialize(), load_config() and the example's --config


def _deep(n: int) -> str:
    return "[" * n + "]" * n


#: case -> (file bytes, key words of the ConfigError); None: the path is made otherwise
CONFIG_FILES: dict[str, tuple[bytes | None, tuple[str, ...]]] = {
    "missing": (None, ("does not exist",)),
    "directory": (None, ("is a directory",)),
    "empty": (b"", ("is empty",)),
    "whitespace": (b"  \n\t\n", ("is empty",)),
    "top_level_array": (b"[1, 2]", ("must hold a JSON object, got list",)),
    "top_level_string": (b'"stage 2"', ("must hold a JSON object, got str",)),
    "top_level_number": (b"3", ("must hold a JSON object, got int",)),
    "invalid_json": (b'{\n  "train_batch_size": 8,,\n}', ("not valid JSON", "line 2 column")),
    "unclosed_object": (b'{"zero_optimization": {"stage": 2}', ("not valid JSON", "line 1")),
    "duplicate_key": (
        b'{"train_batch_size": 8, "train_batch_size": 16}',
        ("'train_batch_size' twice",),
    ),
    "duplicate_nested_key": (
        b'{"zero_optimization": {"stage": 1, "stage": 3}}',
        ("'stage' twice", "DeepSpeed refuses"),
    ),
    "duplicate_key_hjson": (b"{\n  # hjson\n  a: 1\n  a: 2\n}", ("'a' twice",)),
    "deep_arrays": (_deep(100_000).encode(), ("more than 32 levels deep", "line 1 column 33")),
    "deep_objects": (('{"a":' * 5000 + "1" + "}" * 5000).encode(), ("levels deep",)),
    "latin1": ('{"log_level": "café"}'.encode("latin-1"), ("not UTF-8", "byte 0xe9", "line 1")),
    "utf16": ('{"train_batch_size": 8}'.encode("utf-16"), ("not UTF-8",)),
    "binary": (bytes(range(256)), ("not UTF-8",)),
    "too_large": (b'{"a": "' + b"x" * (4 * 2**20) + b'"}', ("larger than 4 MiB",)),
    "unknown_accelerator": (b'{"accelerator": {"nosuch": {}}}', ("accelerator.nosuch", "cpu")),
    "misspelt_accelerator": (b'{"accelerator": {"cpux": {}}}', ("did you mean 'cpu'?",)),
    "unknown_key": (b'{"zero_optimization": {"stgae": 2}}', ("zero_optimization.stage",)),
    "wrong_type": (b'{"zero_optimization": {"stage": "two"}}', ("zero_optimization.stage",)),
    "out_of_range": (b'{"zero_optimization": {"stage": 4}}', ("zero_optimization.stage",)),
}

#: files that look odd but are valid configs: case -> file bytes
CONFIG_ACCEPTED: dict[str, bytes] = {
    "empty_object": b"{}",
    "utf8_bom": '\ufeff{"train_micro_batch_size_per_gpu": 2}'.encode(),
    "other_known_backend_section": b'{"accelerator": {"cpu": {}, "npu": {"x": 1}}}',
    "hjson_comments": b"{\n  # a comment\n  train_micro_batch_size_per_gpu: 2\n}",
    "nesting_within_limit": b'{"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.99]}}}',
    "brackets_inside_strings": ('{"accelerator": {"cpu": {"note": "' + "[" * 100 + '"}}}').encode(),
}


def _config_path(tmp_path: Path, case: str, data: bytes | None) -> Path:
    path = tmp_path / f"{case}.json"
    if case == "directory":
        path.mkdir()
    elif data is not None:
        path.write_bytes(data)
    return path


def _read_through_example(path: Path) -> Any:
    sys.path.insert(0, str(ROOT))
    try:
        from examples.train_gpt import build_config, parse_args
    finally:
        sys.path.remove(str(ROOT))
    return build_config(parse_args(["--config", str(path)]))


@pytest.mark.parametrize("case", sorted(CONFIG_FILES))
def test_bad_config_file_is_one_clear_error(tmp_path: Path, case: str) -> None:
    from ds_core import ConfigError
    from ds_core.zero.config import load_config

    data, words = CONFIG_FILES[case]
    path = _config_path(tmp_path, case, data)
    with pytest.raises(ConfigError) as info:
        load_config(path, 1)
    msg = str(info.value)
    for word in words:
        assert word in msg, (word, msg)
    if not case.startswith(("unknown_", "misspelt_", "wrong_", "out_of_")):
        assert repr(str(path)) in msg, msg  # file errors name the file
        # the example reads --config through the same reader: the same error
        with pytest.raises(ConfigError) as via_example:
            _read_through_example(path)
        assert str(via_example.value) == msg


@pytest.mark.parametrize("case", sorted(CONFIG_ACCEPTED))
def test_odd_but_valid_config_file_is_accepted(tmp_path: Path, case: str) -> None:
    from ds_core.zero.config import load_config

    path = _config_path(tmp_path, case, CONFIG_ACCEPTED[case])
    cfg = load_config(path, 1)
    if case in ("utf8_bom", "hjson_comments"):
        assert cfg.train_micro_batch_size_per_gpu == 2


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads anything")
def test_unreadable_config_file_says_so(tmp_path: Path) -> None:
    from ds_core import ConfigError
    from ds_core.zero.config import load_config

    path = tmp_path / "locked.json"
    path.write_text("{}")
    path.chmod(0)
    with pytest.raises(ConfigError, match="cannot be read: Permission denied"):
        load_config(path, 1)


def test_config_of_another_type_is_one_clear_error() -> None:
    from ds_core import ConfigError
    from ds_core.zero.config import load_config

    with pytest.raises(ConfigError, match="config must be a dict, a path"):
        load_config(b"{}", 1)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# the example's flags (examples/train_gpt.py, refused before torchrun starts)


def _example() -> Any:
    sys.path.insert(0, str(ROOT))
    try:
        import examples.train_gpt as example
    finally:
        sys.path.remove(str(ROOT))
    return example


def _not_a_folder(tmp_path: Path) -> str:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return str(blocker / "out")  # a folder inside a file: unwritable, even for root


#: case -> (flags, key words of the one-line error); {bad} is an unwritable folder
EXAMPLE_FLAGS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "ranks_0": (["--ranks", "0"], ("argument --ranks: must be >= 1, got 0",)),
    "ranks_negative": (["--ranks", "-3"], ("argument --ranks: must be >= 1",)),
    "ranks_word": (["--ranks", "two"], ("--ranks: expected an integer >= 1, got 'two'",)),
    "steps_0": (["--steps", "0"], ("argument --steps: must be >= 1, got 0",)),
    "seq_0": (["--seq", "0"], ("argument --seq: must be >= 1",)),
    "seq_beyond_block": (["--seq", "129"], ("--seq: at most 128 for --model small", "block size")),
    "micro_batch_0": (["--micro-batch", "0"], ("--micro-batch: must be >= 1",)),
    "grad_accum_0": (["--grad-accum", "0"], ("--grad-accum: must be >= 1",)),
    "stage_5": (["--stage", "5"], ("argument --stage: invalid choice",)),
    "model_unknown": (["--model", "huge"], ("argument --model: invalid choice",)),
    "lr_negative": (["--lr", "-1"], ("train_gpt: error:", "optimizer.params.lr: must be >= 0")),
    "out_unwritable": (["--out", "{bad}"], ("train_gpt: error: --out", "cannot write there")),
    "save_dir_unwritable": (["--save-dir", "{bad}"], ("--save-dir", "cannot write there")),
    "config_missing": (["--config", "/nonexistent/ds.json"], ("does not exist",)),
}


@pytest.mark.parametrize("case", sorted(EXAMPLE_FLAGS))
def test_bad_example_flag_is_refused_before_training(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    example = _example()
    launched: list[Any] = []
    monkeypatch.setattr(example, "relaunch_under_torchrun", launched.append)
    flags, words = EXAMPLE_FLAGS[case]
    bad = _not_a_folder(tmp_path)
    argv = ["--out", str(tmp_path / "out")] + [f.replace("{bad}", bad) for f in flags]
    with pytest.raises(SystemExit) as info:
        example.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)
    assert "Traceback" not in err
    assert not launched  # refused before torchrun started


def test_more_ranks_than_cores_warns_with_the_cost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    example = _example()
    cores = len(os.sched_getaffinity(0))
    args = example.parse_args(["--ranks", str(4 * cores), "--out", str(tmp_path)])
    example.preflight(args)  # accepted: oversubscription is allowed, with a warning
    err = capsys.readouterr().err
    assert f"warning: --ranks {4 * cores} on {cores} cores" in err
    assert "4.0x as long" in err


def test_ranks_within_cores_do_not_warn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    example = _example()
    example.preflight(example.parse_args(["--ranks", "1", "--out", str(tmp_path / "o")]))
    assert "warning" not in capsys.readouterr().err
    assert (tmp_path / "o").is_dir()  # created, and the write probe removed
    assert list((tmp_path / "o").iterdir()) == []


def test_the_example_script_refuses_a_bad_config_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2}, "zero_optimization": {}}')
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--config", str(path)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"train_gpt: error: config file {str(path)!r} gives the key 'zero_optimization' twice "
        "in one object; keep one (DeepSpeed refuses duplicate keys too, rather than silently "
        "keep the last)"
    ]


# ---------------------------------------------------------------------------------------------
# the ds-core command


#: case -> (argv, exit status, key words of the one-line error); {bad}: an unwritable folder
CLI_CASES: dict[str, tuple[list[str], int, tuple[str, ...]]] = {
    "new_backend_cpu": (["new-backend", "cpu"], 2, ("'cpu' is the name of ds_core's host CPU",)),
    "new_backend_vendor": (["new-backend", "npu"], 2, ("'npu' is the name", "Huawei Ascend")),
    "new_backend_bad_name": (["new-backend", "Acme-1"], 2, ("must be lowercase letters",)),
    "new_backend_unwritable": (
        ["new-backend", "acme", "--output", "{bad}"],
        2,
        ("--output", "cannot write there"),
    ),
    # --backend is optional to argparse since conformance --coverage, which runs no test
    "conformance_without_backend": (["conformance"], 2, ("--backend NAME is required",)),
    "conformance_report_unwritable": (
        ["conformance", "--backend", "cpu", "--report", "{bad}"],
        2,
        ("--report", "cannot write there"),
    ),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_bad_cli_input_is_one_line_and_exit_status(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ds_core.cli import main

    argv, status, words = CLI_CASES[case]
    bad = _not_a_folder(tmp_path)
    assert main([a.replace("{bad}", bad) for a in argv]) == status
    err = capsys.readouterr().err
    assert err.startswith(f"ds-core {argv[0]}: error: "), err
    assert len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err, (word, err)
    assert not (tmp_path / "ds-core-acme").exists()


def test_new_backend_refuses_an_installed_distribution(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ds_core import cli

    monkeypatch.setattr(
        cli, "_version", lambda d: "1.0" if d == "ds-core-acme" else "not installed"
    )
    assert cli.main(["new-backend", "acme", "--output", str(tmp_path)]) == 2
    assert "the distribution ds-core-acme is installed" in capsys.readouterr().err
    assert not (tmp_path / "ds-core-acme").exists()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([], "the following arguments are required: command"),
        (["nosuch"], "invalid choice: 'nosuch'"),
    ],
)
def test_cli_usage_errors_exit_2(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ds_core.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error: " in err and words in err and "Traceback" not in err


@pytest.mark.parametrize("debug", [False, True])
def test_cli_shows_a_traceback_only_with_debug(tmp_path: Path, debug: bool) -> None:
    argv = ["--debug"] if debug else []
    argv += ["conformance", "--backend", "cpu", "--report", _not_a_folder(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "ds_core.cli", *argv],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert ("Traceback" in proc.stderr) is debug, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("ds-core conformance: error: --report")


def test_cli_help_lists_each_subcommand_with_a_line(capsys: pytest.CaptureFixture[str]) -> None:
    from ds_core.cli import HELP, _commands, main

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in _commands():
        assert name in out and " ".join(HELP[name].split()) in out, name


def test_cli_version_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    from ds_core.cli import _version, main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"ds-core {_version('ds-core')}"


# ---------------------------------------------------------------------------------------------
# the environment: the launcher's variables and DS_ACCELERATOR

_LAUNCH = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_PORT": "29533"}

#: case -> (variables over a one-rank launch, key words of the ConfigError)
ENV_ERRORS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "world_size_word": ({"WORLD_SIZE": "two"}, ("WORLD_SIZE='two'", "an integer >= 1")),
    "world_size_0": ({"WORLD_SIZE": "0"}, ("WORLD_SIZE='0'", "an integer >= 1")),
    "world_size_float": ({"WORLD_SIZE": "2.0"}, ("WORLD_SIZE='2.0'",)),
    "rank_negative": ({"RANK": "-1"}, ("RANK='-1'", "an integer >= 0")),
    "rank_beyond_world": ({"RANK": "3"}, ("RANK=3 and WORLD_SIZE=1", "below WORLD_SIZE")),
    "rank_empty": ({"RANK": ""}, ("RANK=''",)),
    "local_rank_word": ({"LOCAL_RANK": "x"}, ("LOCAL_RANK='x'",)),
    "local_rank_negative": ({"LOCAL_RANK": "-2"}, ("LOCAL_RANK='-2'",)),
    "local_rank_beyond_local_world": (
        {"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
        ("LOCAL_RANK=2 and LOCAL_WORLD_SIZE=2", "below LOCAL_WORLD_SIZE", "--nproc-per-node"),
    ),
    "local_world_size_0": ({"LOCAL_WORLD_SIZE": "0"}, ("LOCAL_WORLD_SIZE='0'", ">= 1")),
    "master_port_word": ({"MASTER_PORT": "http"}, ("MASTER_PORT='http'", "from 1 to 65535")),
    "master_port_beyond": ({"MASTER_PORT": "70000"}, ("MASTER_PORT='70000'", "1 to 65535")),
    "master_port_0": ({"MASTER_PORT": "0"}, ("MASTER_PORT='0'",)),
}


@pytest.mark.parametrize("case", sorted(ENV_ERRORS))
def test_bad_launcher_variable_is_one_clear_error(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ds_core import ConfigError
    from ds_core.comm.groups import check_launcher_env

    env, words = ENV_ERRORS[case]
    for name, value in {**_LAUNCH, **env}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        check_launcher_env()  # what init_distributed checks before torch reads them
    for word in words:
        assert word in str(info.value), (word, str(info.value))


#: DS_ACCELERATOR value -> key words of the BackendSelectionError
ACCELERATOR_ERRORS = {
    "nosuch": ("'nosuch' is not installed", "installed backends: cpu"),
    "cpux": ("Did you mean 'cpu'?",),
    "CPU": ("'CPU' is not installed", "did you mean 'cpu'?"),
    "Sim": ("'Sim' is not installed", "did you mean 'sim'?"),
    "cpu ": ("'cpu ' is not installed",),
}


@pytest.mark.parametrize("value", sorted(ACCELERATOR_ERRORS))
def test_bad_ds_accelerator_is_one_clear_error(value: str) -> None:
    from ds_core.errors import DSCoreError
    from ds_core.plugins import choose, discover

    with pytest.raises(DSCoreError) as info:
        choose(value, discover())
    for word in ACCELERATOR_ERRORS[value]:
        assert word in str(info.value), (word, str(info.value))


def test_the_example_refuses_a_bad_ds_accelerator_before_any_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("DS_ACCELERATOR", "nosuch")
    example = _example()
    launched: list[Any] = []
    monkeypatch.setattr(example, "relaunch_under_torchrun", launched.append)
    with pytest.raises(SystemExit) as info:
        example.main(["--out", str(tmp_path)])
    assert info.value.code == 2 and not launched
    err = capsys.readouterr().err
    assert err.startswith("train_gpt: error: backend 'nosuch' is not installed"), err
    assert len(err.strip().splitlines()) == 1


def test_good_launcher_variables_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_core.comm.groups import check_launcher_env

    # LOCAL_RANK beyond the device count is the backend's check (the CPU has no device index)
    for name, value in {**_LAUNCH, "LOCAL_RANK": "7", "WORLD_SIZE": "8", "RANK": "7"}.items():
        monkeypatch.setenv(name, value)
    check_launcher_env()


def test_the_example_save_on_interrupt_needs_a_save_dir(
    capsys: pytest.CaptureFixture[str],
) -> None:
    example = _example()
    with pytest.raises(SystemExit) as info:
        example.parse_args(["--save-on-interrupt"])
    assert info.value.code == 2
    assert "--save-on-interrupt: needs --save-dir" in capsys.readouterr().err


def test_the_example_save_every_needs_a_save_dir(capsys: pytest.CaptureFixture[str]) -> None:
    example = _example()
    with pytest.raises(SystemExit) as info:
        example.parse_args(["--save-every", "4"])
    assert info.value.code == 2
    assert "--save-every: needs --save-dir" in capsys.readouterr().err
