"""`gpuvigil preflight`: one verdict and an exit code a prolog acts on.

This machine has no GPU and no driver, so the command's own exit code here is CANNOT_CHECK (3),
torch installed or not. The checks themselves run against `tests/fake_pynvml/pynvml.py` (a
stand-in for the pynvml module: same names, NVMLError codes), a fake `dcgmi` script on PATH
printing `dcgmi diag -j` documents in DCGM's shape, InfiniBand port trees laid out as in sysfs,
and torch on the CPU (the memory/matmul load, and a real gloo all-reduce between two processes)."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hyp import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvigil import config
from gpuvigil.cli.main import main
from gpuvigil.preflight import EXIT_CODES, PreflightConfig, run_preflight
from gpuvigil.preflight.checks import check_dcgm, check_infiniband, parse_dcgm_diag
from gpuvigil.preflight.config import DcgmCheckConfig, InfinibandCheckConfig, NcclCheckConfig, TorchLoadCheckConfig
from gpuvigil.preflight.gpu_load import judge_allreduce, judge_load, load_device, run_allreduce

ROOT = Path(__file__).resolve().parents[1]
FAKE_DIR = Path(__file__).parent / "fake_pynvml"


def _fake_module():
    spec = importlib.util.spec_from_file_location("fake_pynvml_for_preflight", FAKE_DIR / "pynvml.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def nv():
    return _fake_module()


def _cfg(**over) -> PreflightConfig:
    return PreflightConfig.model_validate({"checks": ["nvml"], **over})


# -- no GPU here --------------------------------------------------------------------------------


def _cli(args, env_extra=None, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "gpuvigil", "preflight", *args], capture_output=True, text=True, env=env, timeout=timeout, check=False)


def test_no_gpu_here_cannot_check_in_one_line_with_torch_installed():
    import torch  # the machine's torch: CPU-only, so it sees no CUDA device either

    assert not torch.cuda.is_available()
    out = _cli([])
    assert out.returncode == EXIT_CODES["CANNOT_CHECK"] == 3, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("CANNOT_CHECK preflight ") and "no GPU" in lines[0]
    js = _cli(["--json", "--node", "n7"])
    doc = json.loads(js.stdout)
    assert js.returncode == 3 and doc["status"] == "CANNOT_CHECK" and doc["exit_code"] == 3 and doc["node"] == "n7" and doc["checks"] == []


def test_no_pynvml_installed_cannot_check(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    v = run_preflight(PreflightConfig(), node="n1")
    assert v.status == "CANNOT_CHECK" and v.exit_code == 3 and "pynvml" in v.reason


@pytest.mark.parametrize("state", [{"init_error": 12, "gpus": []}, {"gpus": []}], ids=["driver missing", "no GPU listed"])
def test_no_gpu_never_passes_whatever_else_is_configured(nv, state):
    nv.STATE.update(state)
    v = run_preflight(PreflightConfig.model_validate({"checks": ["nvml", "infiniband", "dcgm", "torch_load", "nccl"]}), nvml=nv, node="n1")
    assert v.status == "CANNOT_CHECK" and v.exit_code == 3


# -- NVML: table-driven -------------------------------------------------------------------------

# name → (changes to GPU 1 of two healthy GPUs, config overrides of `nvml`, verdict, fragment of the reason)
NVML_CASES = {
    "healthy": ({}, {}, "PASS", "1 check(s) passed: nvml"),
    "uncorrected ECC": ({"ecc": {"0": 0, "1": 2}}, {}, "FAIL", "GPU 1: 2 volatile uncorrected ECC"),
    "corrected ECC piling up": ({"ecc": {"0": 5000, "1": 0}}, {}, "WARN", "GPU 1: 5000 volatile corrected ECC"),
    "corrected ECC under the limit": ({"ecc": {"0": 12, "1": 0}}, {}, "PASS", "passed"),
    "ECC disabled": ({"ecc_mode": [0, 0]}, {}, "FAIL", "GPU 1: ECC is disabled"),
    "ECC disabled, not required": ({"ecc_mode": [0, 0]}, {"ecc_enabled": False}, "PASS", "passed"),
    "remap pending": ({"remapped": [1, 0, 1, 0]}, {}, "FAIL", "GPU 1: a row remap is pending"),
    "remap failed": ({"remapped": [0, 3, 0, 1]}, {}, "FAIL", "a row remap failed"),
    "remap pending, warn only": ({"remapped": [1, 0, 1, 0]}, {"pending_remap": "warn"}, "WARN", "pending"),
    "PCIe width degraded": ({"pcie_width": 8}, {}, "WARN", "GPU 1: PCIe link x8, the GPU trains at x16"),
    "PCIe width degraded, failing": ({"pcie_width": 8}, {"pcie_width_degraded": "fail"}, "FAIL", "x8"),
    "HW slowdown at idle": ({"reasons": 0x1 | 0x8}, {}, "FAIL", "GPU 1: clocks held down at idle (hw_slowdown)"),
    "power brake at idle": ({"reasons": 0x80}, {}, "FAIL", "hw_power_brake_slowdown"),
    "SW thermal at idle": ({"reasons": 0x20}, {}, "WARN", "sw_thermal_slowdown"),
    "SW power cap is not a fault": ({"reasons": 0x4}, {}, "PASS", "passed"),
    "persistence off": ({"persistence": 0}, {}, "WARN", "GPU 1: persistence mode is off"),
    "persistence off ignored": ({"persistence": 0}, {"persistence_off": "ignore"}, "PASS", "passed"),
    "a process left on the GPU": ({"processes": [4242]}, {}, "FAIL", "GPU 1: 1 process(es) already on it (pid 4242)"),
    "GPU lost": ({"ecc": {"error": 15}}, {}, "FAIL", "GPU 1: cannot read uncorrected ECC errors: GPU is lost"),
    "ECC not supported is not a failure": ({"ecc_mode": {"error": 3}, "ecc": {"error": 3}}, {}, "PASS", "passed"),
    "fewer GPUs than expected": ({}, {"expect_gpus": 8}, "FAIL", "2 GPU(s), expected 8"),
}


@pytest.mark.parametrize("case", list(NVML_CASES))
def test_nvml_checks(nv, case):
    change, over, status, fragment = NVML_CASES[case]
    nv.STATE["gpus"] = [nv.gpu(), nv.gpu(**change)]
    v = run_preflight(_cfg(nvml=over), nvml=nv, node="n1")
    assert v.status == status, v.line()
    assert fragment in v.reason
    assert v.exit_code == EXIT_CODES[status]
    if status != "PASS":
        assert v.failing_check == "nvml" and v.reason.startswith("nvml: ")
    assert nv.STATE["shutdowns"] == 1  # NVML released


def test_a_fail_outranks_warnings_and_the_reason_counts_the_rest(nv):
    nv.STATE["gpus"] = [nv.gpu(persistence=0), nv.gpu(ecc={"0": 0, "1": 1}, pcie_width=4)]
    v = run_preflight(_cfg(), nvml=nv, node="n1")
    assert v.status == "FAIL" and v.reason == "nvml: GPU 1: 1 volatile uncorrected ECC error(s) (max 0)"
    assert [p.level for p in v.checks[0].problems] == ["warn", "fail", "warn"]


# -- the command, with the fake pynvml on PYTHONPATH --------------------------------------------


@pytest.mark.parametrize(
    ("change", "code", "prefix"),
    [({}, 0, "PASS preflight gpu-node-3: "), ({"ecc": {"0": 0, "1": 4}}, 2, "FAIL preflight gpu-node-3: nvml: GPU 0: 4 volatile"), ({"pcie_width": 8}, 1, "WARN preflight gpu-node-3: nvml: GPU 0: PCIe")],
    ids=["pass", "fail", "warn"],
)
def test_command_exit_codes_with_fake_nvml(tmp_path, change, code, prefix):
    nv = _fake_module()
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"gpus": [nv.gpu(**change)]}))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("preflight:\n  checks: [nvml, infiniband, dcgm]\n  dcgm: {command: no-such-dcgmi}\n")
    env = {"PYTHONPATH": f"{FAKE_DIR}{os.pathsep}{ROOT}", "GPUVIGIL_FAKE_NVML": str(state), "SLURMD_NODENAME": "gpu-node-3"}
    out = _cli(["--config", str(cfg), "--sysfs-root", str(tmp_path / "nosys")], env)
    assert out.returncode == code, out.stdout + out.stderr
    assert len(out.stdout.splitlines()) == 1 and out.stdout.startswith(prefix)
    if code == 0:
        assert "skipped: infiniband (no InfiniBand port" in out.stdout and "dcgm (no-such-dcgmi not installed)" in out.stdout


def test_torch_without_cuda_while_nvml_lists_gpus_fails(nv):
    nv.STATE["gpus"] = [nv.gpu()]
    v = run_preflight(_cfg(checks=["nvml", "torch_load", "nccl"]), nvml=nv, node="n1")
    assert v.status == "FAIL" and v.reason == "torch_load: torch sees no CUDA device while NVML lists 1 GPU(s)"
    assert [c.status for c in v.checks] == ["pass", "fail", "skip"]


def test_a_required_check_that_cannot_run_fails(nv):
    nv.STATE["gpus"] = [nv.gpu()]
    v = run_preflight(_cfg(checks=["nvml", "dcgm"], require=["nvml", "dcgm"], dcgm={"command": "no-such-dcgmi"}), nvml=nv, node="n1")
    assert v.status == "FAIL" and v.reason == "dcgm: required, but skipped: no-such-dcgmi not installed"


def test_bad_config_is_exit_2_never_a_pass(tmp_path, capsys):
    for body, fragment in [("preflight:\n  require: [dcgm]\n", "nvml must stay required"), ("preflight:\n  nvml: {fail_clock_reasons: [hw_slowdwn]}\n", "unknown clock reason"),
                           ("preflight:\n  checks: [nvml, gpu_burn]\n", "checks")]:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(body)
        assert main(["preflight", "--config", str(cfg)]) == 2
        assert fragment in capsys.readouterr().err


# -- dcgmi diag ---------------------------------------------------------------------------------


def _dcgm_doc(results: dict[str, list[tuple[str, str, list[str]]]], key: str = "DCGM GPU Diagnostic") -> str:
    cats = [{"category": cat, "tests": [{"name": name, "results": [{"gpu_ids": "0,1", "status": st, **({"warnings": w} if w else {})}]} for name, st, w in tests]} for cat, tests in results.items()]
    return json.dumps({key: {"test_categories": cats, "version": "3.3.5"}})


PASSING = _dcgm_doc({"Deployment": [("Denylist", "Pass", []), ("NVML Library", "Pass", []), ("Persistence Mode", "Pass", [])], "Hardware": [("GPU Memory", "Pass", [])]})
FAILING = _dcgm_doc({"Deployment": [("Denylist", "Pass", []), ("Page Retirement/Row Remap", "Fail", ["GPU 1 had uncorrectable memory errors and row remapping failed."])]})
WARNING = _dcgm_doc({"Deployment": [("Persistence Mode", "Warn", ["Persistence mode for GPU 0 is disabled."]), ("Environmental Variables", "Skip", [])]})


def _fake_dcgmi(tmp_path: Path, stdout: str, rc: int = 0, sleep: float = 0) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (tmp_path / "out.txt").write_text(stdout)
    script = bindir / "dcgmi"
    script.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\nsleep {sleep}\ncat {tmp_path}/out.txt\nexit {rc}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bindir


DCGM_CASES = {
    "pass": (PASSING, 0, "pass", None),
    "a test fails": (FAILING, 226, "fail", "Page Retirement/Row Remap (GPU 0,1): fail: GPU 1 had uncorrectable memory errors"),
    "a warning": (WARNING, 0, "warn", "Persistence Mode (GPU 0,1): warn: Persistence mode for GPU 0 is disabled."),
    "text before the JSON": ("WARNING: something noisy\n" + PASSING, 0, "pass", None),
    "4.x key": (_dcgm_doc({"Deployment": [("Denylist", "Pass", [])]}, key="DCGM Diagnostic"), 0, "pass", None),
    "non-zero exit, every test passing": (PASSING, 1, "fail", "exited 1"),
    "no tests": ('{"DCGM GPU Diagnostic": {"version": "4.2.3"}}', 1, "fail", "ran no test"),
    "runtime error": ('{"DCGM GPU Diagnostic": {"runtime_error": "Unable to connect to host engine"}}', 255, "fail", "Unable to connect to host engine"),
    "garbage": ("Error: \x1b[31mboom\x00\n", 1, "fail", "no JSON in dcgmi output"),
    "unknown status is never a pass": (_dcgm_doc({"Hardware": [("GPU Memory", "Incomplete", [])]}), 0, "fail", "GPU Memory (GPU 0,1): no result (status not recognised)"),
    "every test skipped": (_dcgm_doc({"Hardware": [("GPU Memory", "Skip", [])]}), 0, "skip", None),
}


@pytest.mark.parametrize("case", list(DCGM_CASES))
def test_dcgm_diag_through_a_fake_dcgmi_on_path(tmp_path, monkeypatch, case):
    stdout, rc, status, fragment = DCGM_CASES[case]
    bindir = _fake_dcgmi(tmp_path, stdout, rc)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    r = check_dcgm(DcgmCheckConfig(level=2))
    assert (tmp_path / "args").read_text().split() == ["diag", "-r", "2", "-j"]
    assert r.status == status, r
    if fragment:
        assert any(fragment in p.message for p in r.problems), r.problems
    assert all("\x1b" not in p.message and "\x00" not in p.message for p in r.problems)


def test_unknown_dcgm_status_counts_as_not_run():
    results, err = parse_dcgm_diag(_dcgm_doc({"Hardware": [("GPU Memory", "Incomplete", []), ("Diagnostic", "Pass", [])]}))
    assert err is None and [s for _, s, _ in results] == ["not_run", "pass"]


def test_dcgmi_that_hangs_fails_after_its_timeout(tmp_path, monkeypatch):
    bindir = _fake_dcgmi(tmp_path, PASSING, 0, sleep=30)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    r = check_dcgm(DcgmCheckConfig(timeout_seconds=0.5))
    assert r.status == "fail" and "did not finish in 0.5 s" in r.problems[0].message


def test_dcgm_in_the_whole_preflight(tmp_path, monkeypatch, nv):
    nv.STATE["gpus"] = [nv.gpu(), nv.gpu()]
    monkeypatch.setenv("PATH", f"{_fake_dcgmi(tmp_path, FAILING, 226)}{os.pathsep}{os.environ['PATH']}")
    v = run_preflight(_cfg(checks=["nvml", "dcgm"]), nvml=nv, node="n1")
    assert v.status == "FAIL" and v.failing_check == "dcgm" and v.reason.startswith("dcgm: dcgmi diag -r 1 Page Retirement/Row Remap")


# -- InfiniBand ports in sysfs ------------------------------------------------------------------


def _port(root: Path, dev: str, port: int, state="4: ACTIVE", phys="5: LinkUp", rate="400 Gb/sec (4X NDR)"):
    d = root / "class" / "infiniband" / dev / "ports" / str(port)
    d.mkdir(parents=True)
    (d / "state").write_text(state + "\n")
    (d / "phys_state").write_text(phys + "\n")
    (d / "rate").write_text(rate + "\n")
    (d / "link_layer").write_text("InfiniBand\n")


IB_CASES = {
    "all active": ([{}] * 4, {"expect_ports": 4, "min_rate_gbps": 400}, "pass", None),
    "a port down": ([{}, {"state": "1: DOWN", "phys": "3: Disabled"}, {}, {}], {}, "fail", "mlx5_1 port 1 is DOWN, not ACTIVE"),
    "polling": ([{}, {}, {"state": "2: INIT", "phys": "2: Polling"}, {}], {}, "fail", "mlx5_2 port 1 is INIT, not ACTIVE"),
    "active but not LinkUp": ([{"phys": "6: LinkErrorRecovery"}], {}, "fail", "physical state LinkErrorRecovery, not LinkUp"),
    "active but in physical test mode": ([{"phys": "7: Phy Test"}], {}, "fail", "physical state Phy Test, not LinkUp"),
    "rate fell to HDR": ([{}, {}, {}, {"rate": "200 Gb/sec (4X HDR)"}], {"min_rate_gbps": 400}, "fail", "mlx5_3 port 1 rate 200 Gb/s (4X HDR), expected at least 400 Gb/s"),
    "a port missing": ([{}] * 3, {"expect_ports": 4}, "fail", "3 InfiniBand port(s), expected 4"),
    "the ignored device is down": ([{}, {"state": "1: DOWN"}], {"ignore_devices": ["mlx5_1"]}, "pass", None),
}


@pytest.mark.parametrize("case", list(IB_CASES))
def test_infiniband_ports(tmp_path, case):
    ports, over, status, fragment = IB_CASES[case]
    for i, p in enumerate(ports):
        _port(tmp_path, f"mlx5_{i}", 1, **p)
    r = check_infiniband(tmp_path, InfinibandCheckConfig(**over))
    assert r.status == status, r.problems
    if fragment:
        assert any(fragment in p.message for p in r.problems), r.problems


def test_no_infiniband_is_a_skip_unless_ports_are_expected(tmp_path):
    assert check_infiniband(tmp_path, InfinibandCheckConfig()).status == "skip"
    r = check_infiniband(tmp_path, InfinibandCheckConfig(expect_ports=8))
    assert r.status == "fail" and r.problems[0].message == "0 InfiniBand port(s), expected 8"


# -- torch load and all-reduce, on the CPU ------------------------------------------------------


def test_memory_and_matmul_load_on_cpu():
    r = load_device("cpu", seconds=0.2, memory_bytes=4 << 20, n=128, chunk_bytes=1 << 20)
    assert r["chunks"] == 4 and r["bad_chunks"] == [] and r["finite"] and r["relative_error"] < 1e-3 and r["iterations"] >= 8 and r["tflops"] > 0
    assert judge_load(0, r, TorchLoadCheckConfig()) == []
    slow = judge_load(0, r, TorchLoadCheckConfig(min_tflops=1e6))
    assert [p.level for p in slow] == ["warn"]
    broken = judge_load(3, {**r, "bad_chunks": [1], "finite": False}, TorchLoadCheckConfig())
    assert [p.message for p in broken] == ["GPU 3: memory read back wrong in 1 of 4 chunk(s)", f"GPU 3: matmul result wrong (relative error {r['relative_error']:.3g}, finite False)"]


def test_allreduce_between_two_processes_over_gloo():
    results = run_allreduce(2, NcclCheckConfig(backend="gloo", size_mib=1, iterations=3, timeout_seconds=60))
    assert [r["rank"] for r in results] == [0, 1] and all(r.get("correct") for r in results), results
    r = judge_allreduce(results, NcclCheckConfig(backend="gloo"))
    assert r.status == "pass" and r.detail["ranks"][0]["bus_gbps"] > 0
    lost = judge_allreduce([results[0], {"rank": 1, "error": "did not finish in time"}], NcclCheckConfig())
    assert lost.status == "fail" and lost.problems[0].message == "rank 1: nccl all-reduce failed: did not finish in time"
    wrong = judge_allreduce([{**results[0], "correct": False}], NcclCheckConfig())
    assert wrong.problems[0].message == "rank 0: nccl all-reduce gave a wrong sum"


def test_a_whole_loaded_config_is_accepted(nv):
    nv.STATE["gpus"] = [nv.gpu(pcie_width=8)]
    cfg = config.load(overrides={"preflight": {"checks": ["nvml"], "nvml": {"pcie_width_degraded": "fail"}}})
    v = run_preflight(cfg, nvml=nv, node="n1")
    assert v.status == "FAIL" and "x8" in v.reason


def test_defaults_load_and_match_the_model():
    assert config.section("preflight", PreflightConfig) == PreflightConfig()


# -- the shipped Slurm prolog -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "env", "code"),
    [({"gpus": [{}]}, {}, 0), ({"gpus": [{"ecc": {"0": 0, "1": 3}}]}, {}, 1), ({"gpus": [], "init_error": 12}, {}, 0),
     ({"gpus": [], "init_error": 12}, {"GPUVIGIL_PREFLIGHT_NO_GPU": "drain"}, 1)],
    ids=["pass starts the job", "fail drains", "no GPU on a CPU node", "no GPU drains where asked"],
)
def test_slurm_prolog_maps_the_verdict_to_what_slurm_does(tmp_path, state, env, code):
    nv = _fake_module()
    state = {**state, "gpus": [nv.gpu(**g) for g in state["gpus"]]}
    (tmp_path / "nvml.json").write_text(json.dumps(state))
    (tmp_path / "deploy.yaml").write_text("preflight:\n  dcgm: {command: no-such-dcgmi}\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "gpuvigil"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m gpuvigil "$@"\n')
    wrapper.chmod(0o755)
    run_env = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": f"{FAKE_DIR}{os.pathsep}{ROOT}", "GPUVIGIL_FAKE_NVML": str(tmp_path / "nvml.json"),
               "GPUVIGIL_CONFIG": str(tmp_path / "deploy.yaml"), "GPUVIGIL_PREFLIGHT_CHECKS": "nvml,dcgm", "SLURMD_NODENAME": "gpu-node-9", **env}
    out = subprocess.run(["sh", str(ROOT / "deploy" / "slurm" / "preflight.sh")], env=run_env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == code, out.stdout + out.stderr
    if code:
        assert out.stderr.startswith(("FAIL preflight gpu-node-9: nvml: GPU 0: 3 volatile", "CANNOT_CHECK preflight gpu-node-9: no GPU"))





@settings(max_examples=examples(200), deadline=None)
@given(st.one_of(st.text(max_size=400), st.sampled_from([PASSING, FAILING, WARNING]).map(lambda d: d[: len(d) // 2])))
def test_dcgm_output_parser_never_raises_and_never_invents_a_pass(text):
    results, err = parse_dcgm_diag(text)
    assert all(status in ("pass", "fail", "warn", "skip", "not_run") for _, status, _ in results)
    if '"status"' not in text:
        assert not any(status == "pass" for _, status, _ in results)
