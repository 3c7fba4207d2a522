"""dynarec's C++ extensions' loading (dynarec._cpp_extension): a build newer than every C++ file
of its sources is imported as it is (no build lock, no ninja check: DataLoader workers load it at
once, side by side); anything else goes through torch's load, which checks and builds."""

import os
import subprocess
import sys
import time

from dynarec._cpp_extension import CppExtension
from tests.matrix import needs_fg_kernels


@needs_fg_kernels
def test_an_up_to_date_build_is_imported_without_torchs_build_step():
    code = (
        "import torch.utils.cpp_extension as c\n"
        "def refuse(*a, **k): raise AssertionError('torch load was called')\n"
        "c.load = refuse\n"
        "from dynarec.features import native\n"
        "m = native.ops()\n"
        "assert m is not None and m.__name__ == 'dynarec_fg_ops', m\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr


def test_a_build_older_than_a_source_or_beside_it_is_left_to_torchs_load(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.cpp").write_text("// a")
    (src / "a.h").write_text("// h")
    ext = CppExtension(name="dynarec_test_ext", sources=[str(src / "a.cpp")], what="test", fallback="none")
    build = tmp_path / "build"
    build.mkdir()
    assert ext._up_to_date_build(str(build)) is None  # no build yet
    so = build / "dynarec_test_ext.so"
    so.write_bytes(b"not a shared object")
    past = time.time() - 100
    os.utime(so, (past, past))
    assert ext._up_to_date_build(str(build)) is None  # older than its sources
    os.utime(so, None)
    os.utime(src / "a.cpp", (past, past))
    os.utime(src / "a.h", (past, past))
    assert ext._up_to_date_build(str(build)) is None  # newer, but cannot be imported (being written)
    assert "dynarec_test_ext" not in sys.modules
