"""The check-model report: sections of findings, printed as text or as stable JSON.

JSON schema (version 1; keys are always present, absent values are null):

    {"schema_version": 1, "model": str, "architecture": str, "model_class": "module:Class",
     "ok": bool,
     "sections": [{"name": str, "status": "pass" | "fail" | "skip",
                   "summary": str,
                   "findings": [{"severity": "error" | "warning" | "info", "check": str,
                                 "layer": str | null, "message": str, "fix": str | null}],
                   "data": {...section-specific tables...}}]}

A section fails when it holds at least one "error" finding; "skip" means it did not run (its
one info finding says why). Sections come in a fixed order: contract, prefixes, weights,
quantization, parallel, numerics.
"""

import json
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA_VERSION = 1
SECTION_ORDER = ("contract", "prefixes", "weights", "quantization", "parallel", "numerics")
SEVERITIES = ("error", "warning", "info")


@dataclass
class Finding:
    severity: str        # error fails the section; warning and info do not
    check: str           # a short stable id, e.g. "prefix_mismatch"
    message: str
    layer: str | None = None   # the module path the finding is about (minivllm's tree)
    fix: str | None = None     # the change that would fix it, where one is known

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")


@dataclass
class Section:
    name: str
    findings: list[Finding] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    skipped: bool = False
    summary: str = ""
    text_rows: list[str] = field(default_factory=list)   # tables for the text report only

    def error(self, check: str, message: str, layer: str | None = None,
              fix: str | None = None) -> None:
        self.findings.append(Finding("error", check, message, layer, fix))

    def warning(self, check: str, message: str, layer: str | None = None,
                fix: str | None = None) -> None:
        self.findings.append(Finding("warning", check, message, layer, fix))

    def info(self, check: str, message: str, layer: str | None = None) -> None:
        self.findings.append(Finding("info", check, message, layer))

    def skip(self, reason: str) -> "Section":
        self.skipped = True
        self.info("skipped", reason)
        return self

    @property
    def status(self) -> str:
        if self.skipped:
            return "skip"
        return "fail" if any(f.severity == "error" for f in self.findings) else "pass"

    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]


@dataclass
class Report:
    model: str
    architecture: str
    model_class: str
    sections: dict[str, Section] = field(default_factory=dict)

    def section(self, name: str) -> Section:
        if name not in SECTION_ORDER:
            raise ValueError(f"unknown section {name!r}; sections: {SECTION_ORDER}")
        return self.sections.setdefault(name, Section(name))

    @property
    def ok(self) -> bool:
        return all(s.status != "fail" for s in self.sections.values())

    def to_dict(self) -> dict[str, Any]:
        ordered = [self.sections[n] for n in SECTION_ORDER if n in self.sections]
        return {"schema_version": SCHEMA_VERSION, "model": self.model,
                "architecture": self.architecture, "model_class": self.model_class,
                "ok": self.ok,
                "sections": [{"name": s.name, "status": s.status, "summary": s.summary,
                              "findings": [asdict(f) for f in s.findings], "data": s.data}
                             for s in ordered]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False, default=str)

    def to_text(self) -> str:
        lines = [f"check-model {self.model}", f"  class: {self.model_class} "
                 f"(architecture {self.architecture})", ""]
        for name in SECTION_ORDER:
            if name not in self.sections:
                continue
            sec = self.sections[name]
            head = f"[{sec.status.upper():4}] {name}"
            lines.append(head + (f": {sec.summary}" if sec.summary else ""))
            printed: set[str] = set()
            for f in sec.findings:
                where = f" {f.layer}:" if f.layer else ""
                lines.append(f"  {f.severity:7}{where} {f.message}")
                if f.fix and f.fix not in printed:     # a repeated fix is printed once
                    lines.append(f"           fix: {f.fix}")
                    printed.add(f.fix)
            lines.extend(f"  {row}" for row in sec.text_rows)
        lines.append("")
        lines.append("OK: every check passed" if self.ok else
                     "FAILED: " + ", ".join(n for n, s in self.sections.items()
                                            if s.status == "fail"))
        return "\n".join(lines)
