"""What `kiln.template` defines for template authors: `device_code` (a package's `.cuh` or `.h`
files in a program, compiler messages pointing into them), `c_template_source` (a CPU program's
order) and `Knobs` (a template's knobs as a dataclass)."""
from dataclasses import dataclass

import pytest

from kiln.runtime import cpu as cpu_rt
from kiln.runtime import cuda as rt
from kiln.template import Knobs, c_template_source, device_code, template_source


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package `kiln_test_sdk` with `cuda/bad.cuh`, whose line 3 uses an undeclared name, and
    `cpu/twice.h` (a knob KNOB's double) and `cpu/bad.h`, whose line 2 uses an undeclared name."""
    root = tmp_path / "kiln_test_sdk"
    (root / "cuda").mkdir(parents=True)
    (root / "cpu").mkdir()
    (root / "__init__.py").write_text("")
    (root / "cuda" / "bad.cuh").write_text("// two lines of comment\n//\n"
                                          "static __device__ int kiln_bad() { return undeclared_in_cuh; }\n")
    (root / "cpu" / "twice.h").write_text("enum { TWICE = KNOB * 2 };\n")
    (root / "cpu" / "bad.h").write_text("/* a comment */\n"
                                        "static int kiln_bad(void) { return TWICE + undeclared_in_h; }\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "kiln_test_sdk"


def test_device_code_names_the_file_and_what_follows_it(package):
    text = device_code(package, "cuda/bad.cuh")
    assert text.startswith('#line 1 "kiln_test_sdk/cuda/bad.cuh"\n// two lines of comment\n')
    assert text.endswith('#line 1 "<rendered after kiln_test_sdk/cuda/bad.cuh>"\n')
    assert device_code(package, "cuda/bad.cuh") is text, "read once"


@pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc not installed")
def test_compiler_messages_point_into_the_cuh(package):
    """An error in the file names its line there; one in the code rendered after it counts
    from the line after the file."""
    kernel = 'extern "C" __global__ void k(int* x) {\n  x[0] = kiln_bad() + undeclared_after;\n}\n'
    source = template_source([device_code(package, "cuda/bad.cuh"), kernel], {})
    with pytest.raises(rt.CudaBuildError) as info:
        rt.compile_cubin(source, "bad", "sm_80")
    message = str(info.value)
    assert 'kiln_test_sdk/cuda/bad.cuh(3): error: identifier "undeclared_in_cuh"' in message
    assert '<rendered after kiln_test_sdk/cuda/bad.cuh>(2): error: identifier "undeclared_after"' in message


def test_c_device_code_reads_its_knobs_and_names_each_file(package):
    """Several files in order, each behind its #line, after the prelude, the knobs and the hooks:
    gcc's messages name the file and its line, and the code rendered after the last file."""
    code = device_code(package, "cpu/twice.h", "cpu/bad.h")
    assert code.count("#line 1 ") == 3 and code.index("cpu/twice.h") < code.index('"kiln_test_sdk/cpu/bad.h"')
    hooks = "static int kiln_hook(void) { return 1; }\n"
    source = c_template_source([code, "int kiln_f(void) { return kiln_bad() + undeclared_after; }\n"],
                               {"KNOB": 3}, hooks)
    order = [source.index(part) for part in ("#include <math.h>", "#define KNOB 3\n", hooks, code)]
    assert order == sorted(order), "prelude, knobs, hooks, device code"
    with pytest.raises(cpu_rt.BuildError) as info:
        cpu_rt.build_shared_library(source, "bad")
    message = str(info.value)
    assert "kiln_test_sdk/cpu/bad.h:2:" in message and "undeclared_in_h" in message
    assert "<rendered after kiln_test_sdk/cpu/bad.h>:1:" in message and "undeclared_after" in message


@dataclass(frozen=True)
class Tile(Knobs):
    BM: int = 64
    STAGES: int = 2

    def valid(self) -> bool:
        return self.BM in (64, 128) and self.STAGES >= 1

    @classmethod
    def space(cls, level):
        return [cls()] if level == 0 else cls.grid(BM=(64, 128), STAGES=(2, 3))


def test_knobs_declare_defaults_validity_and_space():
    assert Tile.settings(0) == [{"BM": 64, "STAGES": 2}], "level 0: the defaults"
    assert Tile.settings(1) == [{"BM": 64, "STAGES": 2}, {"BM": 64, "STAGES": 3}, {"BM": 128, "STAGES": 2},
                                {"BM": 128, "STAGES": 3}], "the first knob varies slowest"
    assert Tile(**Tile(BM=128).as_dict()) == Tile(BM=128, STAGES=2)
    with pytest.raises(ValueError, match="Tile: unsupported setting {'BM': 96, 'STAGES': 2}"):
        Tile(BM=96)
    with pytest.raises(TypeError):
        Tile(BN=64)
    assert Knobs.settings(2) == [{}], "a template without knobs has one setting"
