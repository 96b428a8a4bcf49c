"""The commands that compute no KV import no torch (issue 24 item 7): ``--help``, ``stats``,
``verify``, ``gc``, ``ls``, ``sync``, ``prefetch``, ``keygen`` and ``rekey``, and ``import
tiered_kv.storage``. Each runs for real (on stores ``warm-start`` filled, plain and
sealed, LMDB and Zarr) in a fresh interpreter that reports, once the command returned,
whether ``torch`` is in ``sys.modules``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiered_kv.cli.main import ExitCode, main

PROMPTS = [{"id": "p1", "text": "The prefix cache keeps 128-token blocks. " * 8},
           {"id": "p2", "tokens": [(i * 11) % 256 for i in range(140)]}]

#: run in a fresh interpreter: argv[1:] is the command line; the last line of stdout
#: says which exit code it returned and whether torch was imported by then
_CHILD = """
import json, sys
from tiered_kv.cli.main import main
code = main(sys.argv[1:])
print("\\n" + json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def _run(*argv: str) -> tuple[dict, str]:
    """(the child's report, its stderr)"""
    proc = subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A plain and a sealed LMDB store, filled by warm-start (in this process: it needs
    torch), the prompts, and two key files."""
    root = tmp_path_factory.mktemp("no-torch")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    paths = {"root": str(root), "prompts": str(prompts), "plain": str(root / "plain"), "sealed": str(root / "sealed"),
             "k1": str(root / "k1"), "k2": str(root / "k2")}
    assert main(["keygen", paths["k1"]]) == 0 and main(["keygen", paths["k2"]]) == 0
    assert main(["warm-start", "--store", paths["plain"], "--prompts", paths["prompts"]]) == 0
    assert main(["warm-start", "--store", paths["sealed"], "--prompts", paths["prompts"], "--salt", "acme",
                 "--key-file", paths["k1"]]) == 0
    return paths


def test_import_tiered_kv_storage_imports_no_torch_and_no_backend() -> None:
    """Nor a backend or wrapper until one is used: the core imports tiered_kv.storage.format.record
    and .thread_pool, which must not load every backend; every public name still resolves."""
    code = """if True:
        import json, sys
        import tiered_kv, tiered_kv.storage
        lazy = ["chain", "crypto", "encrypted", "lmdb_store", "zarr_store"]
        before = ["torch" in sys.modules, [m for m in lazy if "tiered_kv.storage." + m in sys.modules]]
        from tiered_kv.storage import *
        import tiered_kv.storage as s
        names = [n for n in s.__all__ if getattr(s, n, None) is None]
        print(json.dumps([*before, names, sorted(s.SCHEMES), sorted(s.OBJECT_STORE_SCHEMES), "torch" in sys.modules]))
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [False, [], [], ["lmdb", "zarr"], ["zarr+s3"], False]


def test_the_commands_that_compute_no_kv_import_no_torch(stores: dict[str, str], capsys) -> None:
    capsys.readouterr()
    s = stores
    root = Path(s["root"])
    shared, node, node2 = f"zarr://{root / 'shared'}", str(root / "node"), str(root / "node2")
    commands = [
        (["--help"], ExitCode.OK),
        (["stats", "--store", s["plain"]], ExitCode.OK),
        (["verify", "--store", s["plain"]], ExitCode.OK),
        (["ls", "--store", s["plain"], "--prompts", s["prompts"]], ExitCode.OK),
        (["sync", "--store", s["plain"], "--shared", shared], ExitCode.OK),
        (["stats", "--store", shared], ExitCode.OK),
        (["prefetch", "--from", shared, "--to", node, "--prompts", s["prompts"]], ExitCode.OK),
        (["prefetch", "--from", shared, "--to", node2, "--recent", "3"], ExitCode.OK),
        (["gc", "--store", node, "--max-bytes", "1M"], ExitCode.OK),
        (["keygen", str(root / "k3")], ExitCode.OK),
        (["stats", "--store", s["sealed"], "--key-file", s["k1"], "--tenant", "acme"], ExitCode.OK),
        (["verify", "--store", s["sealed"], "--key-file", s["k1"], "--tenant", "acme"], ExitCode.OK),
        (["rekey", "--store", s["sealed"], "--key-file", s["k2"], "--old-key-file", s["k1"], "--tenant", "acme"],
         ExitCode.OK),
    ]
    for argv, expected in commands:
        got, err = _run(*argv)
        assert got == {"code": expected, "torch": False}, (argv, err)
