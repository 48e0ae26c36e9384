"""A preflight's outcome: one result per check, one verdict for the node, and the exit code a
Slurm prolog or a Kubernetes init container acts on."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

Level = Literal["fail", "warn"]
CheckStatus = Literal["pass", "warn", "fail", "skip"]
VerdictStatus = Literal["PASS", "WARN", "FAIL", "CANNOT_CHECK"]

# Exit codes: a prolog treats any non-zero as "do not run here"; one that tolerates warnings maps 1
# to 0. CANNOT_CHECK (no GPU, no driver) is its own code: the node was not proven fit, and it is
# not proven broken either (a CPU node given the GPU prolog by mistake).
EXIT_CODES: dict[str, int] = {"PASS": 0, "WARN": 1, "FAIL": 2, "CANNOT_CHECK": 3}


class Problem(BaseModel):
    level: Level
    message: str


class CheckResult(BaseModel):
    name: str
    status: CheckStatus
    problems: list[Problem] = Field(default_factory=list)
    # Why a check was skipped, or what it measured (TFLOP/s, bus GB/s, port rates...).
    note: str = ""
    detail: dict[str, Any] = Field(default_factory=dict)
    seconds: float = 0.0

    @classmethod
    def of(cls, name: str, problems: list[Problem], note: str = "", detail: dict[str, Any] | None = None) -> CheckResult:
        status: CheckStatus = "fail" if any(p.level == "fail" for p in problems) else "warn" if problems else "pass"
        return cls(name=name, status=status, problems=problems, note=note, detail=detail or {})

    @classmethod
    def skipped(cls, name: str, why: str) -> CheckResult:
        return cls(name=name, status="skip", note=why)


class Verdict(BaseModel):
    status: VerdictStatus
    node: str
    # The failing (or warning) check and its first problem; the reason it cannot check; or a summary.
    reason: str
    checks: list[CheckResult] = Field(default_factory=list)
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    @property
    def failing_check(self) -> str | None:
        want = {"FAIL": "fail", "WARN": "warn"}.get(self.status)
        return next((c.name for c in self.checks if c.status == want), None)

    def line(self) -> str:
        """The one line a prolog log keeps."""
        return f"{self.status} preflight {self.node}: {self.reason}"

    def to_json_dict(self) -> dict[str, Any]:
        d = self.model_dump(mode="json")
        d["exit_code"] = self.exit_code
        d["failing_check"] = self.failing_check
        return d


def decide(node: str, checks: list[CheckResult], seconds: float) -> Verdict:
    """FAIL if any check failed, else WARN if any warned, else PASS; the reason names the check."""
    for level, status in (("fail", "FAIL"), ("warn", "WARN")):
        bad = [c for c in checks if c.status == level]
        if bad:
            first = bad[0]
            msg = next(p.message for p in first.problems if p.level == level)
            more = sum(1 for c in checks for p in c.problems if p.level == level) - 1
            reason = f"{first.name}: {msg}" + (f" (+{more} more)" if more else "")
            return Verdict(status=status, node=node, reason=reason, checks=checks, seconds=seconds)  # type: ignore[arg-type]
    ran = [c.name for c in checks if c.status == "pass"]
    skipped = [f"{c.name} ({c.note})" if c.note else c.name for c in checks if c.status == "skip"]
    reason = f"{len(ran)} check(s) passed: {', '.join(ran)}" + (f"; skipped: {', '.join(skipped)}" if skipped else "")
    return Verdict(status="PASS", node=node, reason=reason, checks=checks, seconds=seconds)
