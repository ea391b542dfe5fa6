"""Config: defaults, every problem named with its key and value, docs generated from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd import config
from inferd.system import paths

MINIMAL = {"models": {"m": {"inputs": [{"dtype": "float32", "shape": [4]}]}}}


def problems_of(raw) -> list[str]:
    with pytest.raises(config.ConfigError) as info:
        config.parse(raw)
    return info.value.problems


def test_defaults_of_design_md():
    c = config.parse({**MINIMAL, "server": {"state_dir": "/srv/state", "control": "ipc:///tmp/x.sock"}})
    assert c.server.listen == ("tcp://127.0.0.1:5555",)
    assert c.server.metrics == "127.0.0.1:9464"
    assert c.server.max_message_mb == 64 and c.server.drain_timeout_s == 30
    assert (c.workers.devices, c.workers.streams, c.workers.shm_mb, c.workers.cpu_threads) == ("auto", 2, 256, 1)
    assert (c.queue.max_size, c.queue.default_timeout_ms) == (1024, 1000)
    m = c.models["m"]
    assert (m.version, m.max_batch_size, m.max_wait_ms, m.warmup_batch_sizes) == ("latest", 32, 2, (1, 32))
    assert m.repository == "/srv/state/models/m"


def test_control_and_state_default_by_the_writability_rule(monkeypatch, tmp_path):
    monkeypatch.setattr(paths, "_writable", lambda folder: False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    c = config.parse(MINIMAL)
    assert c.server.control == f"ipc://{tmp_path}/inferd/control.sock"
    assert c.server.state_dir == str(tmp_path / "state" / "inferd")
    monkeypatch.setattr(paths, "_writable", lambda folder: True)
    c = config.parse(MINIMAL)
    assert c.server.control == "ipc:///run/inferd/control.sock"
    assert c.server.state_dir == "/var/lib/inferd"


def test_inferctl_finds_an_existing_socket_before_applying_the_rule(monkeypatch, tmp_path):
    monkeypatch.setattr(paths, "SYSTEM_RUNTIME_DIR", tmp_path / "system")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "inferd").mkdir()
    (tmp_path / "inferd" / "control.sock").touch()
    assert paths.find_control() == f"ipc://{tmp_path}/inferd/control.sock"
    (tmp_path / "system").mkdir()
    (tmp_path / "system" / "control.sock").touch()
    assert paths.find_control() == f"ipc://{tmp_path}/system/control.sock"


def test_without_xdg_the_runtime_dir_is_per_uid_under_tmp(monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert str(paths.user_runtime_dir()).startswith("/tmp/inferd-")


IDS = {"dtype": "int64", "shape": [-1], "max_shape": [8], "pad_value": 0, "name": "ids"}


@pytest.mark.parametrize(
    "raw, expected",
    [
        ({**MINIMAL, "server": {"listen": "tcp://x:1"}}, "server.listen: Expected `array`, got `str` 'tcp://x:1'"),
        ({**MINIMAL, "server": {"listen": ["http://x:1"]}}, "server.listen: 'http://x:1' is not an endpoint"),
        ({**MINIMAL, "server": {"metrics": "nope"}}, "server.metrics: 'nope' is not HOST:PORT"),
        ({**MINIMAL, "server": {"max_message_mb": 0}}, "server.max_message_mb: Expected `float` > 0.0, got 0"),
        ({**MINIMAL, "server": {"colour": 1}}, "server.colour: unknown key"),
        ({**MINIMAL, "server": {"max_message_mb": 300}},
         "server.gateway_buffer_mb: 256 is less than server.max_message_mb (300), so a gateway could never take"),
        ({**MINIMAL, "workers": {"devices": "gpu"}}, "workers.devices: 'gpu': use \"auto\""),
        ({**MINIMAL, "workers": {"devices": ["cuda:x"]}}, "workers.devices: 'cuda:x' is not a device"),
        ({**MINIMAL, "workers": {"streams": 0}}, "workers.streams: Expected `int` >= 1, got 0"),
        ({**MINIMAL, "queue": {"max_size": "big"}}, "queue.max_size: Expected `int`, got `str` 'big'"),
        ({**MINIMAL, "extra": {}}, "extra: unknown section"),
        ({"models": {}}, "models: no model is configured"),
        ({"models": {"m": {}}}, "models.m.inputs: required, and missing"),
        ({"models": {"a/b": MINIMAL["models"]["m"]}}, "models.a/b: a model name is"),
        ({"models": {"m": {"inputs": [{"dtype": "f32", "shape": [4]}]}}},
         "models.m.inputs: unknown dtype 'f32'; known: bool, uint8, int8, int16, int32, int64, float16, float32, "
         "float64, bfloat16, bytes"),
        ({"models": {"m": {"inputs": [{"dtype": "bytes", "shape": [-1], "max_shape": [8], "pad_value": 0}]}}},
         "models.m.inputs: input 0 is bytes and has a pad_value: byte strings are not padded"),
        ({"models": {"m": {"inputs": [{"dtype": "float32", "shape": [4, 0]}]}}},
         "models.m.inputs: input 0 has shape [4, 0]: each dim is at least 1, or -1 for a dim of any size"),
        ({"models": {"m": {"inputs": [{"dtype": "int64", "shape": [-1]}]}}},
         "models.m.inputs: input 0 has shape [-1], whose -1 needs a bound: add max_shape, the largest sample it "
         "takes, e.g. max_shape = [512]"),
        ({"models": {"m": {"inputs": [{"dtype": "int64", "shape": [3, -1], "max_shape": [4, 9]}]}}},
         "models.m.inputs: input 0 has max_shape [4, 9], which does not match its shape [3, -1]"),
        ({"models": {"m": {"inputs": [{"dtype": "int64", "shape": [3], "max_shape": [3]}]}}},
         "models.m.inputs: input 0 has max_shape but no -1 in its shape [3]"),
        ({"models": {"m": {"inputs": [{"dtype": "int64", "shape": [3], "pad_value": 0}]}}},
         "models.m.inputs: input 0 has pad_value but no -1 dim: pad_value is for the -1 dims"),
        ({"models": {"m": {"inputs": [IDS, {"dtype": "int64", "shape": [-1], "max_shape": [8]}]}}},
         "models.m.inputs: input 1 has a -1 dim but no pad_value, while input 0 is padded"),
        ({"models": {"m": {"inputs": [{**IDS, "pad_value": None}], "shape_buckets": [4]}}},
         "models.m.shape_buckets: no input has a pad_value, so nothing is padded to a bucket"),
        ({"models": {"m": {"inputs": [IDS], "shape_buckets": [8, 4]}}},
         "models.m.shape_buckets: list each size once, smallest first"),
        ({"models": {"m": {"inputs": [IDS], "outputs": [{"unpad": "mask"}]}}},
         "models.m.outputs: output 0: unpad 'mask' names no input; the inputs are ['ids']"),
        ({"models": {"m": {"inputs": [IDS], "outputs": [{"unpad": "ids:1"}]}}},
         "models.m.outputs: output 0: unpad 'ids:1' must name -1 dims of an input with pad_value; ids is [-1]"),
        ({"models": {"m": {**MINIMAL["models"]["m"], "outputs": [{"name": "y", "dtype": "f32", "shape": [1]}]}}},
         "models.m.outputs: output 0: unknown dtype 'f32'; known: bool"),
        ({"models": {"m": {**MINIMAL["models"]["m"], "outputs": [{"name": "y", "dtype": "float32"}]}}},
         'models.m.outputs: output 0 gives its dtype without its shape: give both, e.g. dtype = "float32", '
         "shape = [10]"),
        ({"models": {"m": {**MINIMAL["models"]["m"], "outputs": [{"dtype": "int64", "shape": [-1]}]}}},
         "models.m.outputs: output 0 has shape [-1], whose -1 needs a bound: add max_shape"),
        ({"models": {"m": {**MINIMAL["models"]["m"], "python": "/nowhere/bin/python"}}},
         "models.m.python: '/nowhere/bin/python' is not an interpreter this user may run; give the path of a "
         "python executable"),
        ({"models": {"m": {**MINIMAL["models"]["m"], "processes": 0}}},
         "models.m.processes: Expected `int` >= 1, got 0"),
        ({"models": {"m": {"inputs": [{"dtype": "float32", "shape": [4], "colour": "x"}]}}},
         "models.m.inputs[0]: Object contains unknown field `colour`"),
        ({"models": {"m": {**MINIMAL["models"]["m"], "version": "../v1"}}}, "models.m.version: '../v1' is not"),
        ({"models": {"m": {**MINIMAL["models"]["m"], "max_batch_size": 4, "warmup_batch_sizes": [1, 8]}}},
         "models.m.warmup_batch_sizes: 8 is over max_batch_size (4)"),
    ],
)
def test_each_problem_names_its_key_and_value(raw, expected):
    problems = problems_of(raw)
    assert any(expected in p for p in problems), problems


def test_every_problem_is_named_not_just_the_first():
    problems = problems_of(
        {"server": {"listen": 1, "drain_timeout_s": -1}, "workers": {"shm_mb": 0},
         "models": {"m": {"inputs": [], "max_batch_size": 0}}}
    )
    keys = {p.split(":")[0] for p in problems}
    assert {"server.listen", "server.drain_timeout_s", "workers.shm_mb", "models.m.inputs",
            "models.m.max_batch_size"} <= keys


def test_load_reports_a_toml_syntax_error_and_a_missing_file(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\n")
    with pytest.raises(config.ConfigError, match="is not valid TOML"):
        config.load(bad)
    with pytest.raises(config.ConfigError, match="cannot read"):
        config.load(tmp_path / "missing.toml")


def model_folder(root: Path, name: str, text: str) -> Path:
    """A folder of server.model_root: `name`/model.toml holding `text`."""
    (root / name).mkdir(parents=True)
    (root / name / "model.toml").write_text(text)
    return root / name


def test_model_root_folders_are_models_served_from_themselves(tmp_path: Path):
    root = tmp_path / "models"
    model_folder(root, "bert", 'inputs = [{ dtype = "int64", shape = [8] }]\nmax_batch_size = 4\n')
    model_folder(root, "resnet", 'inputs = [{ dtype = "float32", shape = [3] }]\n')
    (root / "notes").mkdir()  # no model.toml: not a model
    (tmp_path / "inferd.toml").write_text('[server]\nmodel_root = "models"\n'
                                          '[models.m]\ninputs = [{ dtype = "float32", shape = [4] }]\n')
    c = config.load(tmp_path / "inferd.toml")
    assert sorted(c.models) == ["bert", "m", "resnet"]
    assert c.models["bert"].repository == str(root / "bert") and c.models["bert"].max_batch_size == 4
    assert c.server.model_root == str(root)


def test_model_root_problems_name_the_folder_or_file(tmp_path: Path):
    root = tmp_path / "models"
    model_folder(root, "broken", "inputs = [\n")
    model_folder(root, "wrong", 'inputs = [{ dtype = "float64x", shape = [3] }]\n')
    model_folder(root, "elsewhere", 'repository = "/srv/x"\ninputs = [{ dtype = "float32", shape = [3] }]\n')
    model_folder(root, "m", 'inputs = [{ dtype = "float32", shape = [3] }]\n')
    model_folder(root, "bad name", 'inputs = [{ dtype = "float32", shape = [3] }]\n')
    problems = problems_of({**MINIMAL, "server": {"model_root": str(root)}})
    assert any(p.startswith(f"{root}/broken/model.toml: not valid TOML") for p in problems), problems
    assert any(p.startswith(f"{root}/wrong/model.toml: inputs: unknown dtype") for p in problems), problems
    assert any(p.startswith(f"{root}/elsewhere/model.toml: repository:") for p in problems), problems
    assert any(p.startswith("models.m: also a folder of server.model_root") for p in problems), problems
    assert any("bad name is not a model name" in p for p in problems), problems
    assert len(problems) == 5, problems
    assert problems_of({"server": {"model_root": str(tmp_path / "none")}}) == [
        f"server.model_root: {tmp_path / 'none'} is not a folder"]
    (tmp_path / "empty").mkdir()
    assert problems_of({"server": {"model_root": str(tmp_path / "empty")}}) == [
        "models: no model is configured; add a [models.NAME] table, or a folder with a model.toml to "
        "server.model_root"]


def test_a_bfloat16_input_is_accepted_in_any_precision():
    for precision in ("fp32", "fp16", "bf16"):
        model = {"inputs": [{"dtype": "bfloat16", "shape": [4]}], "precision": precision}
        c = config.parse({"models": {"m": model}})
        assert c.models["m"].inputs[0].dtype == "bfloat16" and c.models["m"].precision == precision


def test_config_survives_the_trip_to_a_worker():
    c = config.parse(MINIMAL)
    assert config.decode(config.encode(c)) == c


def test_the_docs_config_reference_is_generated_from_the_declarations():
    page = (Path(__file__).parent.parent / "docs" / "reference" / "config.md").read_text()
    assert config.reference_markdown() in page, "docs/reference/config.md's config reference is stale: run make docs"


def test_example_config_is_valid():
    example = Path(__file__).parent.parent / "systemd" / "inferd.toml"
    c = config.load(example)
    assert c.models


def test_a_sighup_plan_applies_live_keys_and_keeps_the_rest():
    from inferd.supervisor.control.reconfigure import plan

    def model(shape: int, **knobs) -> dict:
        return {"inputs": [{"dtype": "float32", "shape": [shape]}], **knobs}

    old = config.parse({"queue": {"max_size": 1024}, "workers": {"streams": 2},
                        "models": {"m": model(2, max_wait_ms=1, version="v1")}})
    new = config.parse({"queue": {"max_size": 77}, "workers": {"streams": 4},
                        "models": {"m": model(3, max_wait_ms=5, version="v2"), "n": model(1)}})
    result = plan(old, new)
    assert result.applied == ["queue.max_size 1024 -> 77", "models.m.version 'v1' -> 'v2'",
                              "models.m.max_wait_ms 1 -> 5", "models.n added"]
    assert [line.split()[0] for line in result.need_restart] == ["workers.streams", "models.m.inputs"]
    assert result.added_models == ["n"] and result.version_changed == ["m"]
    assert result.config.queue.max_size == 77 and result.config.workers.streams == 2
    assert result.config.models["m"].max_wait_ms == 5 and result.config.models["m"].inputs[0].shape == (2,)


def test_a_sighup_takes_each_pipeline_as_far_as_the_models_served_from_then_on_run_it():
    from inferd.supervisor.control.reconfigure import plan, settle_pipelines

    def pipeline(model: str, features: int, **knobs) -> dict:
        return {"inputs": [{"name": "x", "dtype": "float32", "shape": [features]}], "outputs": ["y"],
                "steps": [{"model": model, "inputs": {"INPUT__0": "x"}, "outputs": {"OUTPUT__0": "y"}}], **knobs}

    def model(features: int) -> dict:
        return {"inputs": [{"dtype": "float32", "shape": [features]}]}

    old = config.parse({"models": {"m": model(2), "n": model(2)},
                        "pipelines": {"p": pipeline("m", 2), "kept": pipeline("n", 2), "gone": pipeline("n", 2)}})
    # m's new inputs wait for a restart: p's and q's new shape does not fit the m served until then.
    new = config.parse({"models": {"m": model(3), "n": model(2)},
                        "pipelines": {"p": pipeline("m", 3), "q": pipeline("m", 3),
                                      "kept": pipeline("n", 2, max_in_flight=9)}})
    result = settle_pipelines(old.pipelines, new.pipelines, plan(old, new))
    assert result.applied == ["pipelines.gone removed", "pipelines.kept.max_in_flight 256 -> 9"]
    shape = "step m takes tensor 'x' as input 'INPUT__0' of model m, which takes samples of shape [2], but the " \
            "pipeline's input makes them [3]"
    assert result.need_restart[1:] == [f"pipelines.p.steps[0]: {shape}", f"pipelines.q.steps[0]: {shape}"]
    assert result.config.pipelines == {"p": old.pipelines["p"], "kept": new.pipelines["kept"]}
