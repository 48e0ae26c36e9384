"""The configuration is validated as a whole at load.

Every command that takes `--config` validates every section, whichever it uses: a misspelt key
anywhere is an error naming it and the nearest valid key; a binary, badly encoded or malformed
file is one line on stderr and exit code 2, never a traceback. Commands run in-process through
`gpuvigil.cli.main` (the same entry point as the console script)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpuvigil import config
from gpuvigil.cli.main import main

DATA = Path(__file__).parent / "data"

# name → (file name, file bytes, fragments the one-line error must contain)
BAD_FILES: dict[str, tuple[str, bytes, list[str]]] = {
    "typo in a detector key": ("c.yaml", b"detectors:\n  hang:\n    min_stal_seconds: 3\n", ["'detectors.hang.min_stal_seconds'", "did you mean 'min_stall_seconds'"]),
    "typo in a section name": ("c.yaml", b"detektors: {}\n", ["section 'detektors'", "did you mean 'detectors'"]),
    "unknown detector": ("c.yaml", b"detectors:\n  hangg: {}\n", ["'detectors.hangg'", "did you mean 'hang'"]),
    "typo in a nested adapter key": ("c.yaml", b"api:\n  slurm:\n    retry_base_secnds: 1\n", ["'api.slurm.retry_base_secnds'", "did you mean 'retry_base_seconds'"]),
    "typo in a list item": ("c.yaml", b"hints:\n  rules:\n    - {kind: xid, actionz: []}\n", ["'hints.rules[0].actionz'", "did you mean 'actions'"]),
    "typo in the scheduler": ("c.json", b'{"scheduler": {"quota": {"borow": true}}}', ["'scheduler.quota.borow'", "did you mean 'borrow'"]),
    "typo in sources": ("c.yaml", b"sources:\n  kernal_log: kmsg\n", ["'sources.kernal_log'", "did you mean 'kernel_log'"]),
    "bad value": ("c.yaml", b"pipeline:\n  tick_seconds: -1\n", ["config section 'pipeline'", "tick_seconds", "greater than 0"]),
    "binary file": ("c.yaml", bytes(range(256)) * 4, ["binary data"]),
    "latin-1 text": ("c.yaml", "detectors:\n  hang: {min_stall_seconds: 5}  # caf\u00e9\n".encode("latin-1"), ["not UTF-8", "0xe9"]),
    "YAML syntax": ("c.yaml", b"detectors: [unclosed\n", ["not valid YAML"]),
    "JSON syntax": ("c.json", b'{"detectors": ', ["not valid JSON"]),
    "not a mapping": ("c.yaml", b"- a\n- b\n", ["top level must be a mapping"]),
    "missing file": ("absent.yaml", b"", ["cannot read config"]),
}

COMMANDS: dict[str, list[str]] = {
    "analyze": ["analyze", str(DATA / "h200" / "s2_oom_ramp.log"), "--config", "{cfg}"],
    "api": ["api", "--db", "{tmp}/hints.db", "--insecure-local", "--config", "{cfg}"],
    "demo": ["demo", "--scenario", "healthy", "--config", "{cfg}"],
    "alerts build": ["alerts", "build", "--out", "{tmp}/alerts", "--config", "{cfg}"],
    "serve": ["serve", "--config", "{cfg}"],
    "preflight": ["preflight", "--config", "{cfg}"],
}


def _write(tmp_path: Path, name: str, body: bytes) -> Path:
    path = tmp_path / name
    if name != "absent.yaml":
        path.write_bytes(body)
    return path


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(BAD_FILES))
def test_every_command_rejects_a_bad_config_in_one_line(tmp_path, capsys, command, case):
    name, body, fragments = BAD_FILES[case]
    cfg = _write(tmp_path, name, body)
    argv = [a.format(cfg=cfg, tmp=tmp_path) for a in COMMANDS[command]]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("gpuvigil: error: ") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    # Nothing was produced from a config that was refused.
    assert not (tmp_path / "alerts").exists() and not (tmp_path / "hints.db").exists()


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"detectors": {"oom": {"fit_window_second": 1}}}, "did you mean 'fit_window_seconds'"),
        ({"alerts": {"default_tem": "x"}}, "did you mean 'default_team'"),
        ({"api": {"node_health": {"unhealthy_severity": []}}}, "did you mean 'unhealthy_severities'"),
        ({"api": {"kubernetes": {"taint_efect": {}}}}, "did you mean 'taint_effect'"),
        ({"allocator": {"min_unallocated_byte": 1}}, "did you mean 'min_unallocated_bytes'"),
        ({"kernel_log": {"burst_gap": 1}}, "did you mean 'burst_gap_seconds'"),
        ({"xyz_totally_unrelated": {}}, "(valid: acting, alerts, api,"),
        ({"api": {"slurm": {"command_timeout_seconds": 0}}}, "config section 'api.slurm': command_timeout_seconds"),
        ({"detectors": {"anomaly": {"envelope_quantile": 0.2}}}, "config section 'detectors.anomaly': envelope_quantile"),
    ],
)
def test_overrides_are_validated_whole(overrides, fragment):
    with pytest.raises(config.ConfigError) as err:
        config.load(overrides=overrides)
    assert fragment in str(err.value)


def test_every_default_section_has_a_model_and_the_defaults_validate():
    defaults = config.defaults()
    top = {s for s in config.SECTIONS if "." not in s}
    assert set(defaults) == top
    config.validate_all(defaults, "defaults")
    # Every detector block in the defaults has its model (a detector may leave all its
    # thresholds at the model's defaults, with no block).
    assert set(defaults["detectors"]) <= set(config.blocks("detectors") or ())


def test_defaults_are_parsed_once_and_handed_out_as_copies():
    a = config.defaults()
    a["pipeline"]["tick_seconds"] = 99.0
    a["detectors"]["hang"]["min_stall_seconds"] = -5
    b = config.defaults()
    assert b["pipeline"]["tick_seconds"] != 99.0 and b["detectors"]["hang"]["min_stall_seconds"] > 0
    assert config._defaults.cache_info().misses == 1
    # The cache holds what the YAML files say.
    on_disk = yaml.safe_load((Path(config.__file__).parent / "pipeline.yaml").read_text())
    assert b["pipeline"] == on_disk


def test_a_good_user_file_merges_over_the_defaults(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("detectors:\n  hang:\n    min_stall_seconds: 9\nsources:\n  nvml: true\n")
    cfg = config.load(good)
    assert cfg["detectors"]["hang"]["min_stall_seconds"] == 9
    assert cfg["detectors"]["hang"]["step_time_factor"] == config.defaults()["detectors"]["hang"]["step_time_factor"]
