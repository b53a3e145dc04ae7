"""The `kvroute` console command installed by the wheel: `check-config` and `simulate`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvroute

#: The console script next to this interpreter (installed by the wheel's [project.scripts]).
KVROUTE = Path(sys.executable).parent / "kvroute"


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(KVROUTE), *args], input=stdin, capture_output=True, text=True, timeout=120)


def test_the_script_is_installed() -> None:
    assert KVROUTE.exists(), f"{KVROUTE} is missing: is the wheel installed in this environment?"
    out = run("--help")
    assert out.returncode == 0 and "check-config" in out.stdout and "simulate" in out.stdout
    assert run().returncode == 2, "a command is required"


def test_check_config_prints_the_normalized_policy(tmp_path: Path) -> None:
    f = tmp_path / "policy.yaml"
    f.write_text("modes:\n  bypass_prefix_hit: 0.95\nindex:\n  mode: hybrid\n")
    out = run("check-config", str(f))
    assert out.returncode == 0, out.stderr
    assert out.stdout == kvroute.Policy(f).to_json() + "\n"
    doc = json.loads(out.stdout)
    assert doc["modes"]["bypass_prefix_hit"] == 0.95 and doc["index"]["mode"] == "hybrid"
    assert doc["modes"]["decode_kv_ceiling"] == 0.8, "defaults are spelled out"
    assert out.stderr == ""
    piped = run("check-config", "-", stdin='{"index": {"mode": "hybrid"}}')
    assert piped.returncode == 0 and json.loads(piped.stdout)["index"]["mode"] == "hybrid"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("modes:\n  bypass_prefix_hit: 1.5\n", "invalid config: `modes.bypass_prefix_hit` = 1.5"),
        ('{"scoring": {"wieghts": {}}}', "json config error at `scoring.wieghts`: unknown field `wieghts`"),
        ("modes: [\n", "yaml config error at `.`"),
    ],
)
def test_check_config_prints_the_exact_error(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    out = run("check-config", str(f))
    assert out.returncode == 1
    assert out.stdout == ""
    with pytest.raises(kvroute.ConfigError) as e:
        kvroute.Policy(f)
    assert out.stderr == f"kvroute check-config: {f}: {e.value}\n"
    assert message in out.stderr


def test_check_config_missing_file(tmp_path: Path) -> None:
    out = run("check-config", str(tmp_path / "nope.yaml"))
    assert out.returncode == 1 and "nope.yaml" in out.stderr


def test_simulate(tmp_path: Path) -> None:
    svg, js, trace = tmp_path / "sim.svg", tmp_path / "sim.json", tmp_path / "t.jsonl"
    out = run(
        "simulate", "--quick", "--sessions", "16", "--endpoints", "4", "--turns", "2-4",
        "--svg", str(svg), "--json", str(js), "--write-trace", str(trace),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| policy"))
    rows = [line.split("|")[1].strip() for line in lines[header + 2 : header + 5]]
    assert rows == ["round-robin", "least-loaded", "kvroute"]
    assert "kvroute vs round-robin: hit ratio" in out.stdout
    assert svg.read_text().startswith("<svg")
    doc = json.loads(js.read_text())
    assert [r["policy"] for r in doc["reports"]] == rows and doc["cluster"]["endpoints"] == 4
    assert len(trace.read_text().splitlines()) == doc["requests"]
    # The same through the Python API gives the same (deterministic) results.
    api = kvroute.simulate(sessions=16, endpoints=4, turns="2-4")
    strip = ("mean_route_us",)
    assert [{k: v for k, v in r.items() if k not in strip} for r in api.reports] == [
        {k: v for k, v in r.items() if k not in strip} for r in doc["reports"]
    ]
    replay = run("simulate", "--trace", str(trace), "--endpoints", "4", "--policies", "kvroute")
    assert replay.returncode == 0 and f"{doc['requests']} requests" in replay.stdout


def test_simulate_errors(tmp_path: Path) -> None:
    out = run("simulate", "--endpoints", "0", "--sessions", "2")
    assert out.returncode == 1 and "invalid setting `endpoints` = 0" in out.stderr
    out = run("simulate", "--policies", "random", "--sessions", "2")
    assert out.returncode == 1 and 'unknown policy "random"' in out.stderr
    bad = tmp_path / "p.yaml"
    bad.write_text("modes: {colocated_max_risk: 9}\n")
    out = run("simulate", "--policy", str(bad), "--sessions", "2")
    assert out.returncode == 1 and "modes.colocated_max_risk" in out.stderr
    out = run("simulate", "--trace", str(tmp_path / "missing.jsonl"))
    assert out.returncode == 1 and "missing.jsonl" in out.stderr


def test_python_dash_m() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvroute", "check-config", "-"], input="{}", capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and json.loads(out.stdout) == kvroute.Policy().to_dict()
