"""`lucia-supervisor plan`: its table, its JSON, and its exit codes, over a real GGUF library."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from supervisor.memplan.fit import Budget, check
from supervisor.memplan.ledger import Ledger
from supervisor.memplan.need import EngineNeed, figures
from tests.gguf_fixtures import add_model, write_model
from tests.unit.test_cli import write_status

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024**2

ROUTER = """
name = "{name}"
engine = "llama-router"
[library]
models_dir = "{models}"
cache_dir = "{cache}"
[router]
image = "lucia-test/llama:1"
models_max = 2
load_on_startup = {startup}
defaults = {{ ctx-size = "auto" }}
[run]
port = 18080
"""


def _setup(tmp_path: Path, limit_mib: float, startup: str = "[]") -> dict[str, str]:
    models, recipes = tmp_path / "models", tmp_path / "recipes"
    recipes.mkdir()
    # small: 3 layers x 2 heads x (16 + 16) x 2 = 384 B/token, native 2048
    write_model(add_model(models) / "small.gguf", context=2048)
    # wide: 2 layers x 4 heads x (64 + 64) x 2 = 2048 B/token (embedding 256 / 4 heads = 64)
    write_model(
        add_model(models) / "wide.gguf", context=4096, blocks=2, heads=4, kv_heads=4, embedding=256
    )
    # heavy: 1M float32 elements = 4 MiB of weights, 8 MiB with the multiplier
    write_model(add_model(models) / "heavy.gguf", elements=1024 * 1024)
    (recipes / "router.toml").write_text(
        ROUTER.format(name="router", models=models, cache=tmp_path / "cache", startup=startup)
    )
    machine = tmp_path / "machine.toml"
    machine.write_text(
        f'limit = {limit_mib / 1024}\nprofile = "gpu-server"\n[reserves]\nruntime = 0\n'
    )
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "LUCIA_RECIPES_DIR": str(recipes),
        "LUCIA_MACHINE_FILE": str(machine),
        "LUCIA_DATA_DIR": str(tmp_path / "data"),
    }


def _plan(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "plan", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_everything_fits(tmp_path: Path) -> None:
    env = _setup(tmp_path, limit_mib=64)
    done = _plan(env, "router")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == [
        "ENGINE",
        "MODEL",
        "ROLE",
        "WEIGHTS",
        "KV",
        "B/TOKEN",
        "CONTEXT",
        "NEED",
    ]
    rows = {line.split()[1]: line.split() for line in lines[1:] if line.startswith("router ")}
    # ENGINE MODEL ROLE <weights> <unit> KV CONTEXT <need> <unit>
    assert rows["small"][5:7] == ["384", "2048"]  # native: plenty of room
    assert rows["wide"][5:7] == ["2048", "4096"]
    assert "limit     64.0 MiB (fixed)" in done.stdout
    assert "reserves  0 B" in done.stdout
    assert "held      nothing" in done.stdout
    assert "router: fits" in done.stdout


def test_a_model_that_cannot_fit_alone_fails_the_plan(tmp_path: Path) -> None:
    # 6 MiB: heavy needs 8 MiB of weights alone; small and wide fit
    env = _setup(tmp_path, limit_mib=6)
    done = _plan(env, "router", "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    plan = json.loads(done.stdout)
    assert plan["fits"] is False
    assert plan["limit"] == 6 * MIB
    engine = plan["engines"][0]
    roles = {row["model"]: row["role"] for row in engine["models"]}
    assert roles["heavy"] == "does not fit alone"
    assert roles["small"] in {"start", "offered"}
    human = _plan(env, "router")
    assert human.returncode == 1
    assert "not offered (cannot fit even alone): heavy" in human.stdout


def test_startup_set_refused_with_the_guides_wording(tmp_path: Path) -> None:
    env = _setup(tmp_path, limit_mib=6, startup='["heavy"]')
    done = _plan(env, "router")
    assert done.returncode == 1
    assert "The model heavy does not fit after voice, OS, services, and runtime reservations: " in (
        done.stdout
    )
    assert "needs 8.0 MiB, 6.0 MiB left (limit 6.0 MiB, reserves 0 B)." in done.stdout
    assert "Lower ctx-size or load fewer models at start." in done.stdout


def test_what_others_hold_counts(tmp_path: Path) -> None:
    env = _setup(tmp_path, limit_mib=64, startup='["small"]')
    ledger = Ledger.for_data_dir(tmp_path / "data")
    other = EngineNeed("other", (figures("other", 63 * MIB + MIB // 2, 0, 0, multiplier=1.0),))
    assert ledger.claim(
        "other", running=(), decide=lambda held: check(other, Budget(64 * MIB, 0, held))
    ).fits
    done = _plan(env, "router", "--json")  # this test process lives: its claim holds
    plan = json.loads(done.stdout)
    assert plan["held"] == [{"name": "other", "bytes": 63 * MIB + MIB // 2}]
    engine = plan["engines"][0]
    small = next(row for row in engine["models"] if row["model"] == "small")
    # 0.5 MiB left; weights x 2 first, then 384 B a token, rounded down to 256 tokens
    expected = (MIB // 2 - 2 * small["weights"]) // 384 // 256 * 256
    assert 0 < expected < 2048
    assert (small["role"], small["context"]) == ("start", expected)
    assert engine["left"] == MIB // 2
    assert done.returncode == 1  # heavy (8 MiB) cannot fit even alone


def test_a_tensorfold_recipe_is_planned_from_its_memory_section(tmp_path: Path) -> None:
    env = _setup(tmp_path, limit_mib=64)
    text = (ROOT / "recipes/spark-model.toml").read_text()
    recipes = Path(env["LUCIA_RECIPES_DIR"])
    (recipes / "spark-model.toml").write_text(text)
    done = _plan(env, "spark-model")
    assert done.returncode == 1
    # 83.07 GiB measured at startup (counted once) + 19.93 GiB for the full windows
    assert "needs 103.0 GiB, 64.0 MiB left (limit 64.0 MiB, reserves 0 B)" in done.stdout
    start, end = text.index("[memory]"), text.index("[settings]")
    (recipes / "spark-model.toml").write_text(text[:start] + text[end:])
    done = _plan(env, "spark-model")
    assert done.returncode == 1
    assert "spark-model: cannot be planned: the recipe gives no memory figures" in done.stdout


def test_bad_machine_file_is_a_config_error(tmp_path: Path) -> None:
    env = _setup(tmp_path, limit_mib=64)
    Path(env["LUCIA_MACHINE_FILE"]).write_text("[reserves]\nvoice = 2\n")
    done = _plan(env, "router")
    assert done.returncode == 78
    assert "reserves.voice: 2 GiB is below the voice floor" in done.stderr


# --- on an installed host: install.sh's recipes, and files only --------------------------------


def test_the_recipes_install_sh_installed_are_found(tmp_path: Path) -> None:
    env = _setup(tmp_path, limit_mib=64)
    share = tmp_path / "share"
    installed = share / "lucia" / "recipes"  # where install.sh puts them
    installed.parent.mkdir(parents=True)
    Path(env.pop("LUCIA_RECIPES_DIR")).rename(installed)
    env["XDG_DATA_HOME"] = str(share)
    done = _plan(env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "router: fits" in done.stdout


def test_recipes_dir_option_wins_over_the_env(tmp_path: Path) -> None:
    env = _setup(tmp_path, limit_mib=64)
    recipes = env["LUCIA_RECIPES_DIR"]
    env["LUCIA_RECIPES_DIR"] = str(tmp_path / "elsewhere")
    done = _plan(env, "--recipes-dir", recipes)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "router: fits" in done.stdout


def test_no_recipes_is_a_config_error_not_an_empty_plan(tmp_path: Path) -> None:
    env = _setup(tmp_path, limit_mib=64)
    empty = tmp_path / "empty"
    empty.mkdir()
    done = _plan(env, "--recipes-dir", str(empty))
    assert done.returncode == 78
    assert done.stdout == ""
    assert f"no recipes in {empty} (--recipes-dir, env LUCIA_RECIPES_DIR)" in done.stderr


def _claims_with_containers(data: Path, needs: dict[str, int]) -> None:
    """Claims whose starts created their containers: each holds only while its engine runs."""
    ledger = Ledger.for_data_dir(data)
    for name, need in needs.items():  # in progress first (this live process holds them) ...
        engine = EngineNeed(name, (figures(name, need, 0, 0, multiplier=1.0),))
        assert ledger.claim(
            name, running=(), decide=lambda held, e=engine: check(e, Budget(64 * MIB, 0, held))
        ).fits
    for name in needs:  # ... then attached: the pid alone no longer keeps them
        assert ledger.attach(name, f"container-of-{name}")
    assert len(ledger.claims()) == len(needs)


def test_what_running_engines_hold_is_read_from_their_status_files(tmp_path: Path) -> None:
    env = _setup(tmp_path, limit_mib=64)
    data = tmp_path / "data"
    # orphan has no status at all: its engine never ran
    _claims_with_containers(data, {"other": 40 * MIB, "gone": 10 * MIB, "orphan": 5 * MIB})
    # other's worker stopped two minutes ago; its engine still runs, so it still holds
    write_status(data, "other", 3, "running", age=timedelta(minutes=2))
    write_status(data, "gone", 2, "stopped")
    done = _plan(env, "router", "--json")
    plan = json.loads(done.stdout)
    assert plan["held"] == [{"name": "other", "bytes": 40 * MIB}]
    assert plan["engines"][0]["left"] == 24 * MIB


def test_plan_runs_on_a_host_without_docker(tmp_path: Path) -> None:
    """The host has no Docker: plan never imports the Docker SDK or the project's Docker side."""
    env = _setup(tmp_path, limit_mib=64)
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class NoDocker:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'docker' or name.startswith('supervisor.docker'):\n"
        "            raise ImportError(f'{name}: no Docker on this host')\n"
        "        return None\n"
        "sys.meta_path.insert(0, NoDocker())\n"
    )
    env["PYTHONPATH"] = f"{blocker}:{env['PYTHONPATH']}"
    blocked = subprocess.run(
        [sys.executable, "-c", "import docker"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert "no Docker on this host" in blocked.stderr  # the blocker works
    done = _plan(env, "router")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "router: fits" in done.stdout


def test_an_unreadable_model_library_is_said_not_a_traceback(tmp_path: Path) -> None:
    env = _setup(tmp_path, limit_mib=64)
    shutil.rmtree(tmp_path / "models")
    done = _plan(env, "router")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert f"router: cannot be planned: model library {tmp_path / 'models'} cannot be read" in (
        done.stdout
    )
