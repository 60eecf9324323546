"""SGLang's Triton kernels beside ours (bench/kernels.py --vs-sglang): same process, same input
tensors, same CUDA-graph timing (bench.kernels.graph_us), both columns plus the ratio per shape.

SGLang's code is never committed here. scripts/sglang_wheel.sh downloads its wheel (pinned
version, no dependencies) and keeps in .whl-sglang/ only a slim copy of what the bench loads
(`slim_wheel`: python -m bench.sglang_kernels --slim WHEEL DIR); at run time only the modules listed in REAL are
unpacked from it (zipfile) into a temp dir and imported under a private prefix (PRIVATE: the wheel's
`sglang.x.y` is `_sglang_wheel.sglang.x.y` in sys.modules, its import statements rewritten to match,
nothing else in its source touched), so it neither sees nor shadows an `sglang` package installed in
the same process (tests/reference_impls.py imports one). Everything else they import (sgl_kernel,
server args, distributed, env registry, platform probes) is a small stub under the same prefix:
STUBS below, each with the few names the loaded code calls; any other attribute of a stub is a
function that raises, so a path we did not mean to time fails loudly instead of silently running
something else.

What is timed on the SGLang side, per call (all SGLang Triton kernels):
  fused MoE: [fp8: its Triton per-token-group activation quant] -> fused_moe_kernel (gate/up) ->
    act_and_mul_triton (SiLU-and-mul, the kernel its DSV4 path uses) -> [fp8: quant] ->
    fused_moe_kernel (down, routing weight applied) -> moe_sum_reduce_triton (top-k sum).
    Launch configs: its own try_get_optimal_moe_config (its tuned JSON tables for the device and
    Triton version, else its defaults), down config and TMA flags included. On CUDA SGLang itself
    would use CUDA-only kernels (sgl_kernel / JIT) for the activation, the quant and the sum; those
    are not Triton and are not in the wheel in runnable form, so their Triton counterparts stand in.
  sparse MLA decode: triton_sparse_mla_decode_splitk (sglang/kernels/ops/attention/dsa, the
    "DSv4 pattern" split-K decode over a [pages, 1, 576] latent cache with top-k slot indices),
    bf16 cache, its own split heuristic. SGLang 0.5.23 also ships a Triton DSV4 decode
    (kernels/ops/attention/dsv4/triton_sparse_decode, behind SGLANG_HACK_FLASHMLA_BACKEND=triton),
    but it takes only an FP8-quantized cache with d_qk = 512, not our bf16 512 + 64 layout.

Alignment / metadata kernels are timed on NEITHER side: the MoE token-expert alignment is
computed before capture for both (SGLang's moe_align_block_size is a CUDA kernel in sgl_kernel,
which the wheel does not carry; ours is align_tokens), and the graphs hold only the GEMM,
activation and combine launches. Our full fused_moe (alignment included) is reported next to it
as ours_full_us. Sparse MLA decode has no metadata kernel on either side.

Device commands (the lead runs them on the H200, after `bash scripts/sglang_wheel.sh` here; two
calls, as both tables with both sides may not fit one 600 s call):
  run(command="VS_SGLANG=1 ONLY=mla BENCH_S=400 bash scripts/gpu_kernels.sh", carry=[".whl-sglang"])
  run(command="VS_SGLANG=1 SKIP_TESTS=1 ONLY=moe BENCH_S=570 bash scripts/gpu_kernels.sh", carry=[".whl-sglang"])
(the first also runs tests/kernels/test_sglang_kernels.py on the GPU); or directly:
  python -m bench.kernels --json $OUT/bench.json --vs-sglang [--only moe,mla] [--batches 1,8,64]
The table (both columns, ratio, max |diff|) ends the log; the JSON rows carry ours_us, sglang_us,
sglang_over_ours, ours_full_us, sglang_config and the diffs, and meta.sglang the version and stubs.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import re
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import torch
import triton.language as tl

# First, before anything imports triton: without CUDA it switches the Triton interpreter on, and
# Triton decides interpreted-or-compiled when each jit function (its own tl.sum included) is defined.
import runtime.kernels.triton  # noqa: F401, I001

ROOT = Path(__file__).resolve().parent.parent
WHEEL_DIR = ROOT / ".whl-sglang"
MISSING_WHEEL = ("--vs-sglang needs SGLang's wheel in {dir}: run `bash scripts/sglang_wheel.sh` here, "
                 "and on the device machine carry [\".whl-sglang\"].")

# The SGLang modules imported from the wheel (everything else under sglang.* is a stub package or
# a stub module). Module name -> path in the wheel follows the package layout.
REAL = (
    "sglang.kernels.ops.moe.fused_moe_triton_kernels",
    "sglang.kernels.ops.moe.moe_align_small_numel",  # only to check our copy of its buffer layout
    "sglang.kernels.ops.quantization.fp8_kernel",
    "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config",
    "sglang.kernels.ops.attention.dsa.triton_sparse_mla",
    "sglang.kernels.ops.attention.dsa.triton_sparse_mla_decode",
)
# Its tuned fused-MoE launch tables: only the expert count we benchmark.
CONFIG_DIR = "sglang/srt/layers/moe/moe_runner/triton_utils/configs/"
CONFIG_PREFIX = "E=256,"
# The package the wheel's modules (and the stubs) live under in sys.modules. Below it the wheel's own
# names: REAL, the stubs and the error messages use those.
PRIVATE = "_sglang_wheel"
# The loaded code's imports of the wheel's two top-level names, sglang and sgl_kernel.
_FROM_IMPORT = re.compile(r"^(\s*from\s+)((?:sglang|sgl_kernel)\b)", re.MULTILINE)
_PLAIN_IMPORT = re.compile(r"^\s*import\s+(?:sglang|sgl_kernel)\b", re.MULTILINE)


def private(name: str) -> str:
    """The sys.modules name of the wheel's module `name`."""
    return f"{PRIVATE}.{name}"


def wheel_name(name: str) -> str | None:
    """The wheel's name of the sys.modules name `name`, or None outside PRIVATE."""
    return name[len(PRIVATE) + 1:] if name.startswith(PRIVATE + ".") else None


def _privatize(path: Path) -> None:
    """Point the unpacked module's imports of the wheel at PRIVATE (`from sglang.x import y` ->
    `from _sglang_wheel.sglang.x import y`). A plain `import sglang...` would bind the name
    `_sglang_wheel`, not `sglang`: refused, so a wheel version that adds one shows up here."""
    source = path.read_text(encoding="utf-8")
    if _PLAIN_IMPORT.search(source):
        raise ImportError(f"{path.name}: a plain `import sglang...` that bench/sglang_kernels.py does not rewrite")
    path.write_text(_FROM_IMPORT.sub(rf"\g<1>{PRIVATE}.\g<2>", source), encoding="utf-8")


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if _cuda() else (0, 0)


def _bool_env(name: str, default: str = "false") -> bool:
    """SGLang's get_bool_env_var: its default is a string ("true"/"false"), as the variable's text."""
    return os.environ.get(name, default).lower() in ("1", "true")


class _Env:
    """One entry of SGLang's env registry (envs.X.get()): every flag off, as in a default server."""

    def get(self):
        return False


class _Obj(types.SimpleNamespace):
    pass


def _stub_defs() -> dict[str, dict]:
    """sys.modules stubs: module name -> the names the loaded code uses (platform answers for the
    machine we run on; switches as a default server has them)."""
    core_count = (lambda device=0: torch.cuda.get_device_properties(device).multi_processor_count) if _cuda() \
        else (lambda device=0: 8)
    return {
        "sglang.srt.utils": dict(
            is_cuda=_cuda, is_hip=lambda: False, is_cpu=lambda: False, is_musa=lambda: False,
            is_xpu=lambda: False, is_npu=lambda: False, cpu_has_amx_support=lambda: False,
            is_sm90_supported=lambda: _capability() >= (9, 0), is_gfx95_supported=lambda: False,
            get_device_name=lambda device_id=0: torch.cuda.get_device_name(device_id) if _cuda() else "cpu",
            get_device_core_count=core_count, ceil_align=lambda x, a: (x + a - 1) // a * a,
            get_bool_env_var=_bool_env),
        "sglang.srt.utils.patch_torch": dict(register_fake_if_exists=lambda name: (lambda fn: fn)),
        "sglang.srt.environ": dict(envs=_EnvRegistry()),
        "sglang.srt.batch_invariant_ops": dict(is_batch_invariant_mode_enabled=lambda: False),
        "sglang.srt.layers.moe.utils": dict(get_moe_padding_size=lambda use_aiter: 0),
        "sglang.srt.runtime_context": dict(get_exec=lambda: _Obj(
            deterministic=_Obj(enable_deterministic_inference=False),
            moe=_Obj(enable_fused_moe_sum_all_reduce=False))),
        # Programmatic dependent launch on sm90+, as SGLang's own probe decides.
        "sglang.kernels.jit.utils": dict(is_arch_support_pdl=lambda: _capability()[0] >= 9),
        # No override config (its triton_utils/__init__ would import the whole MoE runner).
        "sglang.srt.layers.moe.moe_runner.triton_utils": dict(get_config=lambda: None),
        "sglang.kernels.ops.quantization.fp8_utils": {},
        "sglang.kernels.ops.quantization.int8_kernel": {},
        "sglang.kernels.ops.quantization.per_tensor_quant_fp8": {},
        "sglang.kernels.ops.quantization.per_token_group_quant": {},
        "sglang.kernels.ops.attention.metadata": {},
        "sgl_kernel": {},
    }


class _EnvRegistry:
    def __getattr__(self, name):
        return _Env()


class _StubModule(types.ModuleType):
    """A stub: the defined names, plus a raising function for any other name. As a package it
    imports its REAL submodules on attribute access, like a package whose __init__ is skipped."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{wheel_name(self.__name__) or self.__name__}.{name}"
        if full in REAL or any(r.startswith(full + ".") for r in REAL):
            return importlib.import_module(private(full))

        def stubbed(*args, **kwargs):
            raise NotImplementedError(f"{full} is stubbed by bench/sglang_kernels.py (not a timed Triton path)")
        return stubbed


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves PRIVATE's modules (the wheel's sglang.* and sgl_kernel, under PRIVATE): REAL modules
    from the unpacked files, stubs otherwise; any other module of the wheel is refused, so a new import
    in another wheel version shows up here. Names outside PRIVATE are not its business."""

    def __init__(self, root: Path, stubs: dict):
        self.root, self.stubs = root, stubs
        # Every parent of a real or stubbed module is a package whose __init__ is skipped.
        self.packages = {".".join(r.split(".")[:i]) for r in (*REAL, *stubs) for i in range(1, r.count(".") + 1)}

    def find_spec(self, name, path=None, target=None):
        if name == PRIVATE:
            return importlib.util.spec_from_loader(name, self, is_package=True)
        wheel = wheel_name(name)
        if wheel is None:
            return None
        if wheel in REAL:
            return importlib.util.spec_from_file_location(name, self.root / (wheel.replace(".", "/") + ".py"))
        if wheel in self.stubs or wheel in self.packages:
            return importlib.util.spec_from_loader(name, self, is_package=wheel in self.packages)
        raise ImportError(f"{wheel}: neither unpacked nor stubbed by bench/sglang_kernels.py")

    def create_module(self, spec):
        module = _StubModule(spec.name)
        wheel = wheel_name(spec.name)
        for key, value in self.stubs.get(wheel, {}).items():
            setattr(module, key, value)
        if spec.name == PRIVATE:
            module.__path__ = [str(self.root)]
        elif wheel in self.packages:
            module.__path__ = [str(self.root / wheel.replace(".", "/"))]
        return module

    def exec_module(self, module):
        pass


def wheel_members(zf: zipfile.ZipFile) -> list[str]:
    """What the bench unpacks from the wheel: the REAL modules and the tuned MoE tables of the expert count we run."""
    names = [r.replace(".", "/") + ".py" for r in REAL]
    return names + [n for n in zf.namelist() if n.startswith(CONFIG_DIR) and CONFIG_PREFIX in n.rsplit("/", 1)[-1]]


def slim_wheel(wheel: Path, out_dir: Path) -> Path:
    """A zip of `wheel_members` alone, named `sglang-VERSION-slim.whl` in `out_dir`: what a device call carries
    (76 KB for 0.5.23 against the wheel's 38 MB, so it fits beside .whl in the 64 MiB carry). Never committed."""
    out = out_dir / f"sglang-{wheel_version(wheel)}-slim.whl"
    with zipfile.ZipFile(wheel) as zf:
        members = wheel_members(zf)
        missing = sorted(set(members) - set(zf.namelist()))
        if missing:
            raise SystemExit(f"{wheel.name} lacks what the bench loads: {missing}")
        tmp = out.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as slim:
            for name in members:
                slim.writestr(name, zf.read(name))
    tmp.replace(out)
    return out


def find_wheel(wheel_dir: Path = WHEEL_DIR) -> Path | None:
    wheels = sorted(wheel_dir.glob("sglang-*.whl"))
    return wheels[-1] if wheels else None


def wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


class SGLang:
    """The loaded kernels: .moe_kernels, .fp8, .config, .align_small, .mla (modules)."""

    def __init__(self, wheel: Path | None = None):
        wheel = wheel or find_wheel()
        if wheel is None or not wheel.exists():
            raise SystemExit(MISSING_WHEEL.format(dir=WHEEL_DIR))
        self.wheel, self.version = wheel, wheel_version(wheel)
        self._tmp = tempfile.TemporaryDirectory(prefix="sglang-kernels-")
        root = Path(self._tmp.name)
        with zipfile.ZipFile(wheel) as zf:
            for name in wheel_members(zf):
                zf.extract(name, root)
        for module in REAL:
            _privatize(root / (module.replace(".", "/") + ".py"))
        if PRIVATE in sys.modules:
            raise RuntimeError(f"{PRIVATE} is loaded already: one SGLang per process (`load()`)")
        stubs = _stub_defs()
        self.stubbed = sorted(stubs)
        self._finder = _Finder(root, stubs)
        sys.meta_path.insert(0, self._finder)
        self.moe_kernels = self.module(REAL[0])
        self.align_small = self.module(REAL[1])
        self.fp8 = self.module(REAL[2])
        self.config = self.module(REAL[3])
        self.mla = self.module(REAL[5])

    @staticmethod
    def module(name: str) -> types.ModuleType:
        """The loaded module the wheel calls `name` (one of REAL, or a stub)."""
        return importlib.import_module(private(name))

    # ------------------------------------------------------------ fused MoE

    def moe_configs(self, w13, w2, top_k: int, tokens: int, fp8: bool) -> tuple[dict, dict | None, bool, bool]:
        """SGLang's launch configs for this shape and batch, as its _prepare_fused_moe_run picks them."""
        block_shape = [128, 128] if fp8 else None
        config, (down_config, _) = self.config.try_get_optimal_moe_config(
            tuple(w13.shape), tuple(w2.shape), top_k, "fp8_w8a8" if fp8 else None, tokens,
            block_shape=block_shape, return_down_config=True)
        config = dict(config)
        tma = self.moe_kernels.support_tensor_descriptor()
        up_tma = tma and config.pop("USE_TMA", False)
        down_tma = down_config is not None and down_config.pop("USE_TMA", False) and tma
        return config, down_config, bool(up_tma), bool(down_tma)

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids, meta, configs, w13_scale=None, w2_scale=None):
        """SGLang's Triton MoE launch sequence (see the module docstring), alignment given in meta.
        Mirrors its _fused_moe_kernel_sequence for silu, no bias / hooks / LoRA."""
        k = self.moe_kernels
        config, down_config, up_tma, down_tma = configs
        sorted_ids, expert_ids, num_post = meta
        fp8 = w13_scale is not None
        tokens, top_k = topk_ids.shape
        n2 = w13.shape[1]
        block_shape = [128, 128] if fp8 else None
        padded = min(tokens * top_k, w13.shape[0] + 1) * (config["BLOCK_SIZE_M"] - 1) if down_tma else 0
        total = tokens * top_k + padded
        compute = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
        a1, a1_scale = (self.quant(x) if fp8 else (x, None))
        cache1 = torch.empty(total, n2, device=x.device, dtype=x.dtype)
        k.invoke_fused_moe_kernel(a1, w13, None, cache1, a1_scale, w13_scale, None, topk_weights, topk_ids,
                                  sorted_ids, expert_ids, num_post, False, top_k, config, compute_type=compute,
                                  use_fp8_w8a8=fp8, use_int8_w8a8=False, use_int8_w8a16=False,
                                  use_int4_w4a16=False, per_channel_quant=False, block_shape=block_shape,
                                  c_sorted=down_tma, b_use_tma=up_tma)
        cache2 = torch.empty(total, n2 // 2, device=x.device, dtype=x.dtype)
        k.act_and_mul_triton(cache1, cache2, config, topk_ids, expert_ids, down_tma, "silu")
        a2, a2_scale = (self.quant(cache2) if fp8 else (cache2, None))
        cache3 = torch.empty(tokens, top_k, w2.shape[1], device=x.device, dtype=x.dtype)
        k.invoke_fused_moe_kernel(a2, w2, None, cache3, a2_scale, w2_scale, None, topk_weights, topk_ids,
                                  sorted_ids, expert_ids, num_post, True, 1, down_config or config,
                                  compute_type=compute, use_fp8_w8a8=fp8, use_int8_w8a8=False,
                                  use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False,
                                  block_shape=block_shape, a_use_tma=down_tma, b_use_tma=down_tma,
                                  router_topk=top_k)
        out = torch.empty(tokens, w2.shape[1], device=x.device, dtype=x.dtype)
        k.moe_sum_reduce_triton(cache3, out, 1.0)
        return out

    def quant(self, x):
        """SGLang's Triton per-token-group fp8 quant (group 128, row-major scales): its non-CUDA
        per_token_group_quant_fp8; on CUDA it would call a JIT CUDA kernel instead."""
        return self.fp8._per_token_group_quant_8bit_raw(x.contiguous(), 128)

    # ------------------------------------------------------------ sparse MLA decode

    def sparse_mla(self, q, kv_cache, slots, latent: int, scale: float, workspace: list):
        """q [T, H, C+R], kv_cache [slots, C+R], slots [T, S] -> [T, H, C]; workspace: its grow-only
        split-K buffers, kept by the caller so captured graphs keep their pointers."""
        out = self.mla.triton_sparse_mla_decode_splitk(
            q[..., :latent], q[..., latent:], kv_cache.view(kv_cache.shape[0], 1, -1), slots[:, None, :], scale,
            d_v=latent, workspace=workspace)
        return out[0]


_LOADED: SGLang | None = None


def load() -> SGLang:
    """The process's one SGLang (its modules live under PRIVATE in sys.modules)."""
    global _LOADED
    if _LOADED is None:
        _LOADED = SGLang()
    return _LOADED


def align_like_sglang(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """SGLang's moe_align_block_size buffers ("+1 offset" buckets, none filtered): sorted_token_ids
    (flat routed-row ids grouped by expert, each expert padded to block_size with numel), expert_ids
    per block (-1 past the end), num_tokens_post_padded [1]. Same buffer sizes as its wrapper, so
    the kernels' grids match what SGLang launches. Torch, outside any timed graph."""
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    if numel < num_experts + 1:
        max_padded = numel * block_size
    else:
        max_padded = numel + (num_experts + 1) * (block_size - 1)
    max_padded = (max_padded + 3) // 4 * 4
    max_blocks = -(-max_padded // block_size)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    start = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    first = torch.cumsum(counts, 0) - counts
    expert_of = flat[order]
    rank = torch.arange(numel, device=flat.device) - first[expert_of]
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=flat.device)
    sorted_ids[start[expert_of] + rank] = order.to(torch.int32)
    expert_ids = torch.full((max_blocks,), -1, dtype=torch.int32, device=flat.device)
    blocks = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_size)
    expert_ids[:blocks.numel()] = blocks.to(torch.int32)
    num_post = padded.sum().reshape(1).to(torch.int32)
    return sorted_ids, expert_ids, num_post


def _max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


class VsSGLang:
    """The --vs-sglang side of bench/kernels.py: adds SGLang's time, our time on the same terms,
    the ratio and output checks to the rows bench_moe / bench_mla produce."""

    POLICY = ("alignment/metadata kernels timed on NEITHER side (MoE token-expert alignment computed "
              "before capture for both; ours with alignment: ours_full_us; sparse MLA has none)")

    def __init__(self, graph_us) -> None:
        self.graph_us = graph_us
        self.sgl = load()
        self.mla_workspace: list = []

    def header(self) -> str:
        return (f"vs SGLang {self.sgl.version} ({self.sgl.wheel.name}): its Triton kernels, same inputs, "
                f"CUDA-graph replay; {self.POLICY}; ratio = sglang_us / ours_us (> 1: ours faster)")

    def meta(self) -> dict:
        return dict(version=self.sgl.version, wheel=self.sgl.wheel.name, policy=self.POLICY,
                    modules=list(REAL), stubs=self.sgl.stubbed)

    def moe(self, row: dict, packed, inputs, config, split, reference=None) -> None:
        self._guard(row, self._moe, row, packed, inputs, config, split, reference)

    def mla(self, row: dict, calls_in, cache, latent, scale, reference=None) -> None:
        self._guard(row, self._mla, row, calls_in, cache, latent, scale, reference)

    @staticmethod
    def _guard(row, fn, *args) -> None:
        """One device run measures everything: a failing SGLang call marks its row and the run
        goes on (the error is in the row and the log), instead of losing the rows after it."""
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001
            row["sglang_error"] = f"{type(err).__name__}: {str(err)[:300]}"
            print(f"  sglang {row['kernel']} bs={row['bs']}: {row['sglang_error']}", flush=True)

    def _moe(self, row: dict, packed, inputs, config, split, reference=None) -> None:
        from runtime.kernels.triton import moe
        num_experts, top_k = packed.w2.shape[0], inputs[0][1].shape[1]
        block_m = config.get("BLOCK_M", moe.BLOCK_M)  # the tuned buckets' tile height (32/64 for prefill sizes)
        # Our alignment, computed before capture (fused_moe's `alignment`): the captured launches are
        # exactly fused_moe's minus the alignment. The per-row path (few routed rows) has none.
        alignments = [moe.align_tokens(i, num_experts, block_m) if i.numel() > moe.PER_ROW_MAX_ROWS else None
                      for _, i, _ in inputs]
        ours = lambda x, i, w, a=None: moe.fused_moe(x, packed, w, i, config=config, split_k=split,  # noqa: E731
                                                     alignment=a)
        ours_us = self.graph_us([lambda x=x, i=i, w=w, a=a: ours(x, i, w, a)
                                 for (x, i, w), a in zip(inputs, alignments)])
        configs = self.sgl.moe_configs(packed.w13, packed.w2, top_k, inputs[0][0].shape[0], packed.fp8)
        metas = [align_like_sglang(i, configs[0]["BLOCK_SIZE_M"], num_experts) for _, i, _ in inputs]
        sgl = lambda x, i, w, m: self.sgl.fused_moe(x, packed.w13, packed.w2, w, i, m, configs,  # noqa: E731
                                                    packed.w13_scale, packed.w2_scale)
        sgl_us = self.graph_us([lambda x=x, i=i, w=w, m=m: sgl(x, i, w, m) for (x, i, w), m in zip(inputs, metas)])
        x0, i0, w0 = inputs[0]
        got, want = sgl(x0, i0, w0, metas[0]), ours(x0, i0, w0)
        row.update(ours_full_us=row["us"], ours_us=ours_us, sglang_us=sgl_us, sglang_over_ours=sgl_us / ours_us,
                   sglang_config=dict(up=configs[0], down=configs[1], up_tma=configs[2], down_tma=configs[3]),
                   sglang_max_abs_diff_vs_ours=_max_diff(got, want))
        if reference is not None:
            ref = reference(x0, i0, w0)
            row.update(sglang_max_abs_diff_vs_torch=_max_diff(got, ref),
                       ours_max_abs_diff_vs_torch=_max_diff(want, ref))

    def _mla(self, row: dict, calls_in, cache, latent, scale, reference=None) -> None:
        sgl = lambda q, s: self.sgl.sparse_mla(q, cache, s, latent, scale, self.mla_workspace)  # noqa: E731
        sgl_us = self.graph_us([lambda q=q, s=s: sgl(q, s) for q, s in calls_in])
        q0, s0 = calls_in[0]
        got = sgl(q0, s0)
        row.update(ours_us=row["us"], sglang_us=sgl_us, sglang_over_ours=sgl_us / row["us"])
        if reference is not None:
            row.update(sglang_max_abs_diff_vs_torch=_max_diff(got, reference(q0, s0)))

    def table(self, rows: list) -> str:
        lines = ["== " + self.header(),
                 f"{'kernel':<11}{'variant':<10}{'shape':<20}{'bs':>5}{'ours_us':>10}{'sglang_us':>11}"
                 f"{'ratio':>8}{'ours_full_us':>14}{'max|diff|':>11}"]
        for r in rows:
            if "sglang_us" not in r and "sglang_error" not in r:
                continue
            if r["kernel"] == "fused_moe":
                variant, shape = r["variant"], f"I={r['I']} split={r['split_k']}"
            else:
                variant, shape = "bf16", f"H={r['H']} top-{r['topk']} S={r['selected']}"
            if "sglang_us" not in r:
                head = f"{r['kernel']:<11}{variant:<10}{shape:<20}{r['bs']:>5}"
                lines.append(f"{head}  SGLang failed: {r['sglang_error']}")
                continue
            diff = r.get("sglang_max_abs_diff_vs_torch", r.get("sglang_max_abs_diff_vs_ours"))
            full = f"{r['ours_full_us']:.1f}" if "ours_full_us" in r else "-"
            lines.append(f"{r['kernel']:<11}{variant:<10}{shape:<20}{r['bs']:>5}{r['ours_us']:>10.1f}"
                         f"{r['sglang_us']:>11.1f}{r['sglang_over_ours']:>8.2f}{full:>14}{diff:>11.2e}")
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.sglang_kernels",
                                     description="write the slim copy of an SGLang wheel that the bench loads")
    parser.add_argument("--slim", nargs=2, metavar=("WHEEL", "DIR"), required=True)
    args = parser.parse_args(argv)
    wheel, out_dir = Path(args.slim[0]), Path(args.slim[1])
    if not wheel.is_file():
        parser.error(f"no such wheel: {wheel}")
    out_dir.mkdir(parents=True, exist_ok=True)
    print(slim_wheel(wheel, out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
