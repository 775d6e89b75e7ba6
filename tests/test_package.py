"""Packages (runtime/package.py, frontend/package.py): round trips equal eager,
weights given by name, dynamic batch, every refusal, and loading without a compiler."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rewritec
from models import GPT2Block
from rewritec.cli import main as cli_main
from rewritec.runtime.build import cxx

OPENMP = cxx() is not None


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc2(F.gelu(self.ln(self.fc1(x)))), dim=-1)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x))).mean(dim=(2, 3))


class Reduce(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        y = torch.exp(x - x.amax(dim=1, keepdim=True))
        return y.sum(dim=0), {"norm": (x * x).sum(dim=-1).sqrt()}


class Attention(nn.Module):
    """An ATen op whose name starts with `_` (the CPU's flash attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 6, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 6, 16)


def _model(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    if name == "mlp":
        return MLP().eval(), (torch.randn(4, 16),)
    if name == "conv":
        net = ConvNet().eval()
        with torch.no_grad():  # running statistics other than 0 and 1
            net.bn.running_mean.uniform_(-0.5, 0.5)
            net.bn.running_var.uniform_(0.5, 2.0)
        return net, (torch.randn(2, 3, 8, 8),)
    if name == "attention":
        return Attention().eval(), (torch.randn(2, 6, 16),)
    if name == "gpt2_block":  # its attention becomes rewritec::attention
        return GPT2Block().eval(), (torch.randn(2, 16, 32),)
    return Reduce(), (torch.randn(6, 24),)


@pytest.fixture(scope="module")
def mlp_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, inputs = _model("mlp")
    return rewritec.package(model, inputs, tmp_path_factory.mktemp("pkg") / "mlp.rwc")


@pytest.mark.parametrize("name", ["mlp", "conv", "reduce", "attention", "gpt2_block"])
def test_round_trip_equals_eager(name: str, tmp_path: Path) -> None:
    model, inputs = _model(name)
    path = rewritec.package(model, inputs, tmp_path / f"{name}.rwc")
    loaded = rewritec.load_package(path)
    with torch.no_grad():
        want = model(*inputs)
    torch.testing.assert_close(loaded(*inputs), want)
    manifest = loaded.manifest
    assert manifest["versions"]["torch"] == torch.__version__
    if OPENMP and name != "attention":  # the package runs generated kernels, not only ATen
        assert manifest["target"]["kernels"] == "openmp"
        assert any(m.endswith(".so") for m in manifest["members"])
        assert manifest["target"]["cpu"] and "-march=native" in manifest["target"]["flags"]


def test_every_member_is_hashed(mlp_package: Path) -> None:
    with zipfile.ZipFile(mlp_package) as z:
        manifest = json.loads(z.read("manifest.json"))
        names = set(z.namelist()) - {"manifest.json"}
        assert names == set(manifest["members"])
        for name in names:
            assert hashlib.sha256(z.read(name)).hexdigest() == manifest["members"][name]
        assert {"program.json", "exported.txt", "wrapper.py"} <= names


def test_aten_target_package(tmp_path: Path) -> None:
    model, inputs = _model("mlp")
    path = rewritec.package(model, inputs, tmp_path / "a.rwc", options={"target": "aten"})
    loaded = rewritec.load_package(path)
    assert loaded.manifest["target"] == {"device": "cpu", "kernels": "aten"}
    torch.testing.assert_close(loaded(*inputs), model(*inputs))


def test_frozen_constants_are_stored(tmp_path: Path) -> None:
    model, inputs = _model("conv")
    path = rewritec.package(model, inputs, tmp_path / "f.rwc", options={"freeze": True})
    loaded = rewritec.load_package(path)
    assert any(m.startswith("constants/") for m in loaded.manifest["members"])
    torch.testing.assert_close(loaded(*inputs), model(*inputs))
    with pytest.raises(rewritec.PackageError, match="weights=False cannot be combined"):
        rewritec.package(model, inputs, tmp_path / "g.rwc", weights=False,
                         options={"freeze": True})


def test_weights_left_out_come_from_state_dict(tmp_path: Path) -> None:
    model, inputs = _model("mlp")
    path = rewritec.package(model, inputs, tmp_path / "w.rwc", weights=False)
    with zipfile.ZipFile(path) as z:
        assert not any(n.startswith("weights/") for n in z.namelist())
    with pytest.raises(rewritec.PackageError, match="weight 'fc1.weight' is not in the package"):
        rewritec.load_package(path)
    other = MLP().eval()  # the same structure, other weights
    loaded = rewritec.load_package(path, state_dict=other.state_dict())
    torch.testing.assert_close(loaded(*inputs), other(*inputs))
    bad = dict(other.state_dict(), **{"ln.weight": torch.ones(31)})
    with pytest.raises(rewritec.PackageError, match=r"weight 'ln.weight' is \(\(31,\)"):
        rewritec.load_package(path, state_dict=bad)


def test_dynamic_batch_stays_dynamic(tmp_path: Path) -> None:
    model, inputs = _model("mlp")
    batch = torch.export.Dim("batch", min=2, max=64)
    path = rewritec.package(model, inputs, tmp_path / "d.rwc",
                            dynamic_shapes=({0: batch},))
    loaded = rewritec.load_package(path)
    assert list(loaded.manifest["dynamic"].values()) == [[2, 64]]
    for n in (2, 5, 13, 64):
        x = torch.randn(n, 16)
        torch.testing.assert_close(loaded(x), model(x))
    with pytest.raises(rewritec.PackageError, match="takes 2..64"):
        loaded(torch.randn(65, 16))
    with pytest.raises(rewritec.PackageError, match="size 15 in dim 1, the package was "
                                                    "compiled for 16"):
        loaded(torch.randn(4, 15))


def test_static_package_refuses_other_sizes(mlp_package: Path) -> None:
    loaded = rewritec.load_package(mlp_package)
    with pytest.raises(rewritec.PackageError, match="size 5 in dim 0, the package was "
                                                    "compiled for 4"):
        loaded(torch.randn(5, 16))
    with pytest.raises(rewritec.PackageError, match="float64"):
        loaded(torch.randn(4, 16, dtype=torch.float64))


# --------------------------------------------------------------------------- refusals


def _rewrite(src: Path, dst: Path, change: dict[str, bytes | None],
             manifest: dict | None = None) -> Path:
    """A copy of package `src` with members replaced, added or (None) dropped; the
    manifest as given (default: the original, so hashes no longer match)."""
    with zipfile.ZipFile(src) as z:
        members = {n: z.read(n) for n in z.namelist()}
    members.update({k: v for k, v in change.items() if v is not None})
    for k in [k for k, v in change.items() if v is None]:
        members.pop(k)
    if manifest is not None:
        members["manifest.json"] = json.dumps(manifest).encode()
    with zipfile.ZipFile(dst, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return dst


def _manifest(path: Path) -> dict:
    with zipfile.ZipFile(path) as z:
        return json.loads(z.read("manifest.json"))


def test_tampered_member_is_refused(mlp_package: Path, tmp_path: Path) -> None:
    with zipfile.ZipFile(mlp_package) as z:
        weights = bytearray(z.read("weights/0.bin"))
    weights[0] ^= 1
    bad = _rewrite(mlp_package, tmp_path / "t.rwc", {"weights/0.bin": bytes(weights)})
    with pytest.raises(rewritec.PackageError, match=r"t\.rwc: member weights/0.bin was "
                                                    r"changed: its sha256 is"):
        rewritec.load_package(bad)


def test_flipped_byte_in_file_is_refused(mlp_package: Path, tmp_path: Path) -> None:
    data = bytearray(mlp_package.read_bytes())
    with zipfile.ZipFile(mlp_package) as z:
        info = z.getinfo("program.json")
    data[info.header_offset + 30 + len(info.filename) + 5] ^= 0xFF  # inside its bytes
    bad = tmp_path / "f.rwc"
    bad.write_bytes(bytes(data))
    with pytest.raises(rewritec.PackageError, match=r"f\.rwc: member program.json "
                                                    r"(is damaged|was changed)"):
        rewritec.load_package(bad)


def test_truncated_file_is_refused(mlp_package: Path, tmp_path: Path) -> None:
    bad = tmp_path / "cut.rwc"
    bad.write_bytes(mlp_package.read_bytes()[:-200])
    with pytest.raises(rewritec.PackageError, match=r"cut\.rwc: truncated or damaged"):
        rewritec.load_package(bad)


def test_foreign_files_are_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("model.pt", b"weights")
    with pytest.raises(rewritec.PackageError, match=r"other\.zip: not a rewritec package"):
        rewritec.load_package(other)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(rewritec.PackageError, match=r"notes\.txt: not a rewritec package "
                                                    r"\(not a zip file\)"):
        rewritec.load_package(text)
    with pytest.raises(rewritec.PackageError, match="no such file"):
        rewritec.load_package(tmp_path / "missing.rwc")


def test_other_torch_version_is_refused(mlp_package: Path, tmp_path: Path) -> None:
    manifest = _manifest(mlp_package)
    manifest["versions"]["torch"] = "1.0.0"
    bad = _rewrite(mlp_package, tmp_path / "v.rwc", {}, manifest)
    with pytest.raises(rewritec.PackageError,
                       match=re.escape(f"made for torch 1.0.0, this is torch {torch.__version__}")):
        rewritec.load_package(bad)


def test_other_triton_version_is_refused(mlp_package: Path, tmp_path: Path) -> None:
    manifest = _manifest(mlp_package)
    manifest["versions"]["triton"] = "0.0.1"
    manifest["target"] = {"device": "cuda", "kernels": "triton", "arch": "sm_90"}
    bad = _rewrite(mlp_package, tmp_path / "tr.rwc", {}, manifest)
    with pytest.raises(rewritec.PackageError, match="made for Triton 0.0.1, this is Triton"):
        rewritec.load_package(bad)


@pytest.mark.skipif(not OPENMP, reason="no C++ compiler: no OpenMP kernels")
def test_other_cpu_target_is_refused(mlp_package: Path, tmp_path: Path) -> None:
    manifest = _manifest(mlp_package)
    mine = manifest["target"]["cpu"]
    manifest["target"]["cpu"] = "0123456789abcdef"
    bad = _rewrite(mlp_package, tmp_path / "c.rwc", {}, manifest)
    with pytest.raises(rewritec.PackageError, match=f"built for CPU target 0123456789abcdef, "
                                                    f"this machine's is {mine}"):
        rewritec.load_package(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_package_without_gpu_is_refused(mlp_package: Path, tmp_path: Path) -> None:
    manifest = _manifest(mlp_package)
    manifest["target"] = {"device": "cuda", "kernels": "aten"}
    bad = _rewrite(mlp_package, tmp_path / "g.rwc", {}, manifest)
    with pytest.raises(rewritec.PackageError, match="made for cuda"):
        rewritec.load_package(bad)


def test_pickle_member_is_refused(mlp_package: Path, tmp_path: Path) -> None:
    import pickle

    data = pickle.dumps({"x": 1})
    manifest = _manifest(mlp_package)
    manifest["members"]["data.pkl"] = hashlib.sha256(data).hexdigest()
    bad = _rewrite(mlp_package, tmp_path / "p.rwc", {"data.pkl": data}, manifest)
    with pytest.raises(rewritec.PackageError, match=r"holds 'data.pkl', which is not plain"):
        rewritec.load_package(bad)


@pytest.mark.parametrize("step", [
    {"out": "v99", "fn": "builtins.eval", "args": ["1"]},
    {"out": "v99", "op": "aten::_foreach_add.List", "args": [], "kwargs": {"x\nimport os": 1}},
    {"out": "v99\nimport os", "op": "aten::t.default", "args": [{"v": "a0"}]},
    {"out": "v99", "op": "torch.load", "args": []},
    {"out": "v99", "op": "aten::__class__.__init__", "args": []},
])
def test_program_names_only_allowed_calls(mlp_package: Path, tmp_path: Path,
                                          step: dict) -> None:
    with zipfile.ZipFile(mlp_package) as z:
        program = json.loads(z.read("program.json"))
    program["graph"]["steps"].insert(0, step)
    data = json.dumps(program).encode()
    manifest = _manifest(mlp_package)
    manifest["members"]["program.json"] = hashlib.sha256(data).hexdigest()
    bad = _rewrite(mlp_package, tmp_path / "s.rwc", {"program.json": data}, manifest)
    with pytest.raises(rewritec.PackageError, match=r"s\.rwc: program.json"):
        rewritec.load_package(bad)


@pytest.mark.parametrize("change", [{"device": "warp-drive"}, {"shape": [-4, 16]},
                                    {"dtype": "f99"}, {"member": "weights/99.bin"}])
def test_malformed_tensor_metadata_is_refused(mlp_package: Path, tmp_path: Path,
                                              change: dict) -> None:
    with zipfile.ZipFile(mlp_package) as z:
        program = json.loads(z.read("program.json"))
    program["weights"]["fc1.weight"].update(change)
    data = json.dumps(program).encode()
    manifest = _manifest(mlp_package)
    manifest["members"]["program.json"] = hashlib.sha256(data).hexdigest()
    bad = _rewrite(mlp_package, tmp_path / "m.rwc", {"program.json": data}, manifest)
    with pytest.raises(rewritec.PackageError,
                       match=r"m\.rwc: (program.json is malformed|weights/0.bin holds)"):
        rewritec.load_package(bad)


def test_interpreted_triton_kernels_are_refused(tmp_path: Path) -> None:
    """Under TRITON_INTERPRET=1 there is no binary to package."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter on the CPU")
    model, inputs = _model("mlp")
    with pytest.raises(rewritec.PackageError, match="has no Triton binaries"):
        rewritec.package(model, inputs, tmp_path / "t.rwc", options={"target": "triton"})


def test_packaged_triton_binary_is_found_by_its_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plumbing of a loaded Triton kernel, on the CPU: a launch whose call the
    package holds a binary for runs it (the static launcher stubbed), and so does a
    call the binary's specialization admits (other sizes of a dynamic dim); any
    other call is one error, never Triton's JIT."""
    from rewritec.runtime import package as fmt
    from rewritec.runtime import static_launch
    from rewritec.runtime.triton_direct import DirectKernel, call_key

    x = torch.zeros(8)
    ran: list[tuple] = []
    monkeypatch.setattr(static_launch, "launcher",
                        lambda meta, path, device, grid: lambda *a: ran.append((path, grid, a)))
    meta = {"name": "k0", "keep": [0, 1], "codes": "Oi"}
    odd, sixteen = call_key((x, 9), {"BLOCK": 16}), call_key((x, 32), {"BLOCK": 16})
    binaries = [fmt.Binary(repr(c), repr(c[0]), fmt.assumptions(c, meta), meta, path)
                for c, path in ((odd, "odd.cubin"), (sixteen, "d16.cubin"))]
    kernel = DirectKernel(load=fmt._no_jit("p.rwc", "k0"), binaries=fmt.PackagedBinaries(
        binaries), symbol="k0", device=lambda: 0)
    kernel[(1,)](x, 9, BLOCK=16)  # its own call
    kernel[(2,)](x, 11, BLOCK=16)  # admitted by the binary compiled for an odd size
    kernel[(2,)](x, 48, BLOCK=16)  # both admit it: the one with a divisibility hint
    assert [r[0] for r in ran] == ["odd.cubin", "odd.cubin", "d16.cubin"]
    assert ran[1] == ("odd.cubin", (2,), (x, 11))
    for args, kwargs in (((x, 9), {"BLOCK": 32}), ((x.double(), 9), {"BLOCK": 16}),
                         ((x, 2**40), {"BLOCK": 16}), ((x[1:], 9), {"BLOCK": 16})):
        with pytest.raises(rewritec.PackageError, match="p.rwc: kernel k0 has no binary for "
                                                        "this call"):
            kernel[(1,)](*args, **kwargs)


@pytest.mark.parametrize("name", ["mlp", "reduce"])
def test_a_kernel_that_cannot_launch_runs_its_aten_body(name: str, tmp_path: Path) -> None:
    """Every packaged kernel carries its group as ATen calls: a launch that fails
    (here: every kernel's library call raising) gives eager's result, with a
    warning, instead of an error."""
    from rewritec.runtime.launch import KernelFallback, Launcher

    model, inputs = _model(name)
    path = rewritec.package(model, inputs, tmp_path / "p.rwc")
    with zipfile.ZipFile(path) as z:
        kernels = json.loads(z.read("program.json"))["kernels"]
    assert kernels and all("aten" in k for k in kernels)
    assert [k["matrix_products"] for k in kernels] == [False] * len(kernels)  # no matmul kind
    loaded = rewritec.load_package(path)
    wrapper = getattr(loaded._fn, "fn", loaded._fn)  # under a PlannedGraph, its wrapper
    launchers = [v for v in wrapper.__globals__.values() if isinstance(v, Launcher)]
    assert len(launchers) == len(kernels)

    def broken(*args: object) -> None:
        raise RuntimeError("the library lost its kernel")

    for launcher in launchers:
        launcher.fn = launcher.kernel = broken
    with pytest.warns(KernelFallback, match="falls back to ATen"):
        got = loaded(*inputs)
    torch.testing.assert_close(got, model(*inputs))


def test_a_call_that_cannot_launch_falls_back_alone() -> None:
    """runtime/launch.py: NoLaunch sends one call through ATen (warned once) and
    keeps launching the calls that can, learning no plan from the one that fell."""
    from rewritec.runtime.launch import KernelFallback, Launcher, NoLaunch

    class Flaky(Launcher):
        def launch(self, *inputs: torch.Tensor) -> torch.Tensor:
            if inputs[0].shape[0] == 3:
                raise NoLaunch("no binary for size 3")
            return inputs[0] + 1

    spec = type("Spec", (), {"name": "k0", "rule": "r"})()
    launcher = Flaky(spec, None, lambda x: x + 2)  # type: ignore[arg-type]
    with pytest.warns(KernelFallback, match="k0 .rule r. runs a call through ATen: no binary"):
        assert launcher(torch.zeros(3)).tolist() == [2.0] * 3
    assert launcher(torch.zeros(2)).tolist() == [1.0] * 2
    assert launcher(torch.zeros(3)).tolist() == [2.0] * 3
    assert launcher.calls_fell_back == 2 and not launcher.failed


def test_binary_assumptions_follow_triton_specialization() -> None:
    """An argument compiled in (a constexpr, or an int equal to 1) must be equal; a
    multiple of 16 must stay one; an int must fit the binary's type."""
    from rewritec.runtime import package as fmt

    f32 = torch.float32
    call = ((("BLOCK", 64),), ((f32, 0), (f32, 8), 1, 32, 7, 5, (float, 0.5)))
    meta = {"keep": [0, 1, 3, 4, 6], "codes": "OOilf"}
    assume = fmt.assumptions(call, meta)
    assert assume == [["ptr", "torch.float32", True], ["ptr", "torch.float32", False],
                      ["=", "1"], ["int", -2**31, 2**31 - 1, True],
                      ["int", -2**63, 2**63 - 1, False], ["=", "5"], ["float"]]
    admitted = ((f32, 0), (f32, 0), 1, 64, 2**40, 5, (float, 2.0))
    assert fmt.admits(assume, admitted)
    for k, other in ((0, (f32, 8)), (0, (torch.float16, 0)), (2, 2), (3, 48 + 8),
                     (3, 2**31), (5, 6), (6, (int, 2))):
        bad = list(admitted)
        bad[k] = other
        assert not fmt.admits(assume, tuple(bad)), (k, other)
    assert not fmt.admits(assume, admitted[:-1])


def test_probe_sizes_cover_each_block_until_nothing_is_new() -> None:
    """Odd sizes first (no divisibility hint), then 2**k + 1 while new binaries come."""
    from rewritec.frontend.package import probe_sizes

    made = iter([1, 2, 2, 2, 9])  # binaries made so far, at each count (then 9)
    got = list(probe_sizes({"b": [2, 64], "s": [1, None]}, {"b": 8, "s": 4},
                           lambda: next(made, 9)))
    assert got[0] == {"b": 3, "s": 3}
    # b: 17 makes a new binary, 33 and 65 (past the range) none: stop at the end
    assert got[1:3] == [{"b": 17, "s": 3}, {"b": 33, "s": 3}]
    # s: 17 makes new binaries, 33 and 65 none: two idle probes end it
    assert [g["s"] for g in got[3:]] == [17, 33, 65]
    assert list(probe_sizes({"b": [4, 4]}, {"b": 4}, lambda: 0)) == [{"b": 4}]


def _cuda(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model, inputs = _model(name)
    return model.cuda(), tuple(x.cuda() for x in inputs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["mlp", "reduce"])
def test_cuda_package_of_triton_binaries(name: str, tmp_path: Path) -> None:
    model, inputs = _cuda(name)
    path = rewritec.package(model, inputs, tmp_path / "t.rwc")
    loaded = rewritec.load_package(path)
    target = loaded.manifest["target"]
    major, minor = torch.cuda.get_device_capability()
    assert target["kernels"] == "triton" and target["arch"] == f"sm_{major}{minor}"
    assert any(m.endswith(".cubin") for m in loaded.manifest["members"])
    with torch.no_grad():
        want = model(*inputs)
    torch.testing.assert_close(loaded(*inputs), want)
    torch.testing.assert_close(loaded(*inputs), want)  # through its launch plans


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_package_loads_without_compiling(tmp_path: Path) -> None:
    model, inputs = _cuda("mlp")
    path = rewritec.package(model, inputs, tmp_path / "t.rwc")
    with torch.no_grad():
        torch.save((inputs[0], model(*inputs)), tmp_path / "io.pt")
    res = subprocess.run([sys.executable, "-c", NO_COMPILER, str(path), str(tmp_path / "io.pt")],
                         capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,dim,low,high", [("mlp", 0, 1, 300), ("reduce", 1, 2, 3000)],
                         ids=["batch", "row-width"])
def test_cuda_package_with_dynamic_dims(name: str, dim: int, low: int, high: int,
                                        tmp_path: Path) -> None:
    """Triton binaries made at the probe sizes serve every size in the dim's range
    (odd, multiples of 16, 1), loaded in a process that compiles nothing. A batch
    dim changes no kernel's block, so every call launches a binary (a fallback
    would raise); a row width whose reduction the package has no binary for runs
    that call's ATen body, so results stay eager's."""
    model, inputs = _cuda(name)
    n = torch.export.Dim("n", min=low, max=high)
    path = rewritec.package(model, inputs, tmp_path / "d.rwc", dynamic_shapes=({dim: n},))
    assert list(rewritec.load_package(path).manifest["dynamic"].values()) == [[low, high]]
    pairs = []
    for size in sorted({low, 2, 7, 16, 48, 129, 1000, high}):
        if low <= size <= high:
            shape = list(inputs[0].shape)
            shape[dim] = size
            x = torch.randn(shape, device="cuda")
            with torch.no_grad():
                pairs.append((x, model(x)))
    torch.save(pairs, tmp_path / "io.pt")
    strict = ["strict"] if name == "mlp" else []
    res = subprocess.run([sys.executable, "-c", NO_COMPILER, str(path), str(tmp_path / "io.pt"),
                          *strict], capture_output=True, text=True, timeout=300, check=False,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]


def test_cudagraphs_option(mlp_package: Path) -> None:
    """A CPU package is never replayed; an unknown value is one error naming the file."""
    assert rewritec.load_package(mlp_package).cudagraphs is None
    assert rewritec.load_package(mlp_package, cudagraphs=True).cudagraphs is None
    with pytest.raises(rewritec.PackageError, match=r"mlp\.rwc: cudagraphs='maybe': give "
                                                    "'auto', 'on' or 'off'"):
        rewritec.load_package(mlp_package, cudagraphs="maybe")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["gpt2_block", "conv"])
def test_cuda_package_replays_cuda_graphs(name: str, tmp_path: Path) -> None:
    """Calls of a loaded CUDA package are replayed as CUDA graphs (from the second call
    of a shape); every result the caller holds stays its own (never overwritten by a
    later replay), inputs refilled in place or new alike; `off` replays nothing."""
    model, inputs = _cuda(name)
    path = rewritec.package(model, inputs, tmp_path / "g.rwc")
    loaded = rewritec.load_package(path, cudagraphs="on")
    assert loaded.cudagraphs is not None
    x = inputs[0].clone()
    with torch.no_grad():
        for _ in range(4):  # a loop `y = f(x)`: replayed from the second call
            x.copy_(torch.randn_like(x))
            y = loaded(x)
            torch.testing.assert_close(y, model(x))
    assert loaded.cudagraphs.replays >= 3
    held = []
    for k in range(4):  # results held: never overwritten (busy graphs run plainly)
        if k % 2:
            x.copy_(torch.randn_like(x))  # the same buffer, refilled
        else:
            x = torch.randn_like(x)
        with torch.no_grad():
            held.append((x.clone(), loaded(x)))
    with torch.no_grad():
        for xs, got in held:
            torch.testing.assert_close(got, model(xs))
    assert rewritec.load_package(path, cudagraphs="off").cudagraphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_package_refusals(tmp_path: Path) -> None:
    model, inputs = _cuda("mlp")
    path = rewritec.package(model, inputs, tmp_path / "t.rwc")
    manifest = _manifest(path)
    manifest["target"]["arch"] = "sm_10"
    bad = _rewrite(path, tmp_path / "arch.rwc", {}, manifest)
    with pytest.raises(rewritec.PackageError, match="built for GPU architecture sm_10"):
        rewritec.load_package(bad)
    aten = rewritec.package(model, inputs, tmp_path / "a.rwc", options={"target": "aten"})
    loaded = rewritec.load_package(aten)
    assert loaded.manifest["target"] == {"device": "cuda", "kernels": "aten"}
    torch.testing.assert_close(loaded(*inputs), model(*inputs))
    with pytest.raises(rewritec.PackageError, match="on cpu, the package takes"):
        loaded(inputs[0].cpu())


def test_mutating_model_is_refused(tmp_path: Path) -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.add_(1)
            return x * 2

    with pytest.raises(rewritec.PackageError, match="writes an input or buffer in place"):
        rewritec.package(Counter(), (torch.randn(3),), tmp_path / "m.rwc")


# --------------------------------------------------------------------------- no compiler


NO_COMPILER = textwrap.dedent("""
    import subprocess, sys
    def refuse(*a, **k):
        raise AssertionError("a process was started while loading: " + repr(a[:1]))
    subprocess.Popen = refuse  # g++ above all
    import torch
    def refuse_fn(name):
        def fn(*a, **k):
            raise AssertionError(name + " was called while loading")
        return fn
    torch.compile = refuse_fn("torch.compile")
    torch.export.export = refuse_fn("torch.export.export")
    import rewritec
    if sys.argv[3:] == ["strict"]:  # every call launches a kernel: none falls back
        import warnings
        warnings.filterwarnings("error", message="rewritec: kernel")
    io = torch.load(sys.argv[2], weights_only=True)
    loaded = rewritec.load_package(sys.argv[1])
    for x, want in io if isinstance(io, list) else [io]:  # (input, result) pairs
        torch.testing.assert_close(loaded(x), want)
    forbidden = ["rewritec.compiler", "rewritec.rulesets", "rewritec.engine.rules",
                 "rewritec.engine.rewrite", "rewritec.engine.pipeline", "rewritec.kinds.kernels",
                 "rewritec.kinds.templates", "rewritec.runtime.prepare", "torch._dynamo",
                 "torch._functorch.aot_autograd", "torch._inductor", "jinja2", "lark", "yaml"]
    loaded_mods = [m for m in forbidden if m in sys.modules]
    loaded_mods += [m for m in sys.modules if m.startswith("rewritec.frontend")]
    assert not loaded_mods, loaded_mods
    print("loaded without compiling")
""")


def test_load_runs_no_compiler(mlp_package: Path, tmp_path: Path) -> None:
    """In a fresh process: no TorchDynamo, AOTAutograd, rule loading, code generation
    or compiler process while loading and calling; the result equals eager."""
    model, inputs = _model("mlp")
    with torch.no_grad():
        torch.save((inputs[0], model(*inputs)), tmp_path / "io.pt")
    res = subprocess.run([sys.executable, "-c", NO_COMPILER, str(mlp_package),
                          str(tmp_path / "io.pt")], capture_output=True, text=True, timeout=120,
                         check=False, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loaded without compiling" in res.stdout


# --------------------------------------------------------------------------- CLI


def test_cli_compile_package(tmp_path: Path) -> None:
    script = tmp_path / "m.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16)).eval()
        example_inputs = (torch.randn(3, 8),)
        dynamic_shapes = ({0: torch.export.Dim("batch", max=32)},)
    """))
    path = tmp_path / "m.rwc"
    code = cli_main(["compile", str(script), "--package", str(path), "--quiet", "--profile",
                     "--out", str(tmp_path / "out")])
    assert code == 0
    scope: dict = {}
    exec(script.read_text(), scope)  # noqa: S102 - the test's own script
    loaded = rewritec.load_package(path)
    for n in (3, 7):
        x = torch.randn(n, 8)
        torch.testing.assert_close(loaded(x), scope["model"](x))


def test_cli_package_needs_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "f.py"
    script.write_text("import torch\ny = torch.compile(lambda x: x.sin())(torch.randn(4))\n")
    code = cli_main(["compile", str(script), "--package", str(tmp_path / "f.rwc"), "--quiet",
                     "--out", str(tmp_path / "out")])
    assert code == 2
    assert "defines no module-level `model`" in capsys.readouterr().err
