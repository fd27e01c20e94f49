"""LoRA adapters on a running transformers model, several in one forward pass.

Adapters are PEFT's (`adapter_config.json` + weights, read by peft's own loaders), kept
resident up to `max_loras` (least recently used evicted; one a running sequence uses is never
evicted, so more may be resident while they all run). A forward pass may mix tokens of the
base and of several adapters: PEFT's mixed-adapter batches (`adapter_names=` per row) need a
row per sequence, but continuous batching packs every sequence into one row, so the same sum
is taken per token span instead. Each target Linear gets one hook computing, for the whole
pass, `(x @ A_all.T * mask) @ B_all.T` where A_all / B_all stack every resident adapter's
A / B and the mask holds each token's adapter's scaling in that adapter's rank columns (zero
for base tokens): two small matmuls per layer however many adapters the pass mixes.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenyard.errors import FatalError, InvalidRequest

# a pass's spans: (adapter name, first token, end token) over the packed tokens
Spans = Sequence[tuple[str, int, int]]


@dataclass
class _Adapter:
    name: str
    path: str
    scaling: float
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], B [out, r])
    users: int = 0  # running sequences that use it: never evicted while any does


@dataclass
class _Pass:
    """One forward pass's routing; the mask is built once, by the first hook that needs it."""

    spans: Spans
    masks: dict[int, torch.Tensor] = field(default_factory=dict)


def load_peft_adapter(
    name: str, path: str, modules: Mapping[str, torch.nn.Module], dtype: torch.dtype
) -> _Adapter:
    """A PEFT LoRA adapter's weights by the model's module names; what it cannot be run as
    (another PEFT method, DoRA, per-module ranks, a module that is no Linear) is refused."""
    try:
        from peft import LoraConfig
        from peft.utils import load_peft_weights
    except ImportError as exc:  # the hf extra brings it; a slimmer install may not have it
        raise InvalidRequest(
            f"cannot load LoRA adapter '{name}': peft is not installed here "
            "(pip install 'tokenyard[hf]')"
        ) from exc
    try:
        config = LoraConfig.from_pretrained(path)
        state = load_peft_weights(path, device="cpu")
    except Exception as exc:  # a missing directory, a hub id that is not there, bad files
        raise InvalidRequest(f"cannot load LoRA adapter '{name}' from {path}: {exc}") from exc
    if config.use_dora or config.rank_pattern or config.alpha_pattern or config.fan_in_fan_out:
        raise InvalidRequest(
            f"LoRA adapter '{name}': DoRA, rank/alpha patterns and fan_in_fan_out are not run"
        )
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if key.endswith(suffix):
                module = key.removesuffix(suffix).removeprefix("base_model.model.")
                pairs.setdefault(module, {})[part] = tensor
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in pairs.items():
        target = modules.get(module)
        if not isinstance(target, torch.nn.Linear) or len(ab) != 2:
            raise InvalidRequest(f"LoRA adapter '{name}' targets {module}: not a Linear here")
        device = target.weight.device
        weights[module] = (ab["lora_A"].to(device, dtype), ab["lora_B"].to(device, dtype))
    if not weights:
        raise InvalidRequest(f"LoRA adapter '{name}' at {path} holds no LoRA weights")
    rank = int(config.r)
    alpha = float(config.lora_alpha)
    scaling = alpha / (rank**0.5) if config.use_rslora else alpha / rank
    return _Adapter(name, path, scaling, rank, weights)


class LoraSet:
    """The adapters one model runs with. `ensure` / `release` bracket a sequence's use;
    `plan` names the next forward pass's spans; the model's forward takes them (`attach`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        paths: Mapping[str, str],
        max_loras: int,
        dtype: torch.dtype,
        loader: Callable[..., _Adapter] = load_peft_adapter,
    ) -> None:
        if max_loras < 1:
            raise FatalError(f"max_loras is {max_loras}: at least one adapter must fit")
        self.model = model
        self.paths = dict(paths)
        self.max_loras = max_loras
        self.dtype = dtype
        self.loader = loader
        self.modules = dict(model.named_modules())
        # held around each forward pass and each restacking: a load never changes the
        # stacked weights under a pass (taken by an add only when an adapter is loaded)
        self.lock = threading.RLock()
        # the resident set's bookkeeping (order, users): brief, never held across a pass, so
        # adding a sequence of a resident adapter does not wait for the running step
        self._book = threading.Lock()
        self._resident: OrderedDict[str, _Adapter] = OrderedDict()  # least recent first
        # adapter -> its rank columns and scaling, as the stacked weights hold them
        self._offsets: dict[str, tuple[int, int, float]] = {}
        self._stacked: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # (A_all.T, B_all.T)
        self._hooked: set[str] = set()
        self._next: Spans = ()
        self._pass: _Pass | None = None
        self.loads = 0  # adapters loaded from disk, evictions' reloads included
        self.loads_of: dict[str, int] = {}  # the same, by adapter
        self.mixed_passes = 0  # passes that ran base tokens beside two or more adapters
        self.widest_pass = 0  # the most adapters one pass ran

    @property
    def resident(self) -> list[str]:
        with self._book:
            return list(self._resident)

    @property
    def stacked(self) -> bool:
        """Whether any adapter's weights are in the stack (a pass may need them)."""
        return bool(self._offsets)

    def users(self, name: str) -> int:
        """Running sequences that use `name` (0: none, or not resident)."""
        with self._book:
            found = self._resident.get(name)
            return 0 if found is None else found.users

    def ensure(self, name: str, path: str = "") -> None:
        """Make `name` resident (loading it from its configured path, else `path`) and count
        one more sequence using it; an adapter neither names is the request's fault."""
        if self._use(name):
            return
        where = self.paths.get(name) or path
        if not where:
            raise InvalidRequest(
                f"The model '{name}' does not exist", param="model", code="model_not_found"
            )
        loaded = self.loader(name, where, self.modules, self.dtype)  # off every lock: disk I/O
        with self.lock:  # no pass runs while the stack changes
            with self._book:
                if name not in self._resident:  # else another add loaded it meanwhile
                    self.loads += 1
                    self.loads_of[name] = self.loads_of.get(name, 0) + 1
                    self._resident[name] = loaded
                self._resident.move_to_end(name)
                self._resident[name].users += 1  # before evicting: it is in use
                self._evict()
                resident = list(self._resident.items())
            self._restack(resident)

    def preload(self, name: str, path: str = "") -> None:
        """Make `name` resident, used by no sequence yet (the most recently used), so that the
        `ensure` of the add that follows finds it; what fails is left for that add to raise."""
        with contextlib.suppress(Exception):
            self.ensure(name, path)
            self.release(name)

    def _use(self, name: str) -> bool:
        with self._book:
            found = self._resident.get(name)
            if found is None:
                return False
            self._resident.move_to_end(name)
            found.users += 1
            return True

    def release(self, name: str) -> None:
        with self._book:
            found = self._resident.get(name)
            if found is not None and found.users > 0:
                found.users -= 1

    def _evict(self) -> None:
        """Drop least recently used adapters no sequence uses, down to `max_loras`."""
        over = len(self._resident) - self.max_loras
        for name in [n for n, a in self._resident.items() if a.users == 0][: max(0, over)]:
            del self._resident[name]

    def _restack(self, resident: list[tuple[str, _Adapter]]) -> None:
        """Stack the resident adapters' weights per module (zeros where one does not target
        it), and hook every module some adapter targets."""
        offsets: dict[str, tuple[int, int, float]] = {}
        total = 0
        for name, adapter in resident:
            offsets[name] = (total, total + adapter.rank, adapter.scaling)
            total += adapter.rank
        targets = {m for _, a in resident for m in a.weights}
        stacked: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for module in targets:
            linear = self.modules[module]
            assert isinstance(linear, torch.nn.Linear)
            device = linear.weight.device
            a_all = torch.zeros(total, linear.in_features, device=device, dtype=self.dtype)
            b_all = torch.zeros(linear.out_features, total, device=device, dtype=self.dtype)
            for name, adapter in resident:
                if module in adapter.weights:
                    lo, hi, _ = offsets[name]
                    a, b = adapter.weights[module]
                    a_all[lo:hi] = a
                    b_all[:, lo:hi] = b
            # kept transposed, as the hook multiplies by them: [in, R] and [R, out]
            stacked[module] = (a_all.T.contiguous(), b_all.T.contiguous())
            if module not in self._hooked:
                self.modules[module].register_forward_hook(self._hook(module))
                self._hooked.add(module)
        self._offsets, self._stacked = offsets, stacked

    def plan(self, spans: Spans, base_tokens: int = 0) -> None:
        """The spans of the next forward pass (set on the thread that runs it, before it),
        beside `base_tokens` tokens run without an adapter."""
        self._next = spans
        width = len({name for name, _, _ in spans})
        self.widest_pass = max(self.widest_pass, width)
        if base_tokens and width > 1:
            self.mixed_passes += 1

    def attach(self) -> None:
        """Route the model's forward through the spans `plan` set: each pass takes them."""
        forward = self.model.forward

        def routed(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                spans, self._next = self._next, ()
                self._pass = _Pass(spans) if spans else None

                try:
                    return forward(*args, **kwargs)
                finally:
                    self._pass = None

        self.model.forward = routed

    def _mask(self, current: _Pass, tokens: int, like: torch.Tensor) -> torch.Tensor:
        mask = current.masks.get(tokens)
        if mask is None:
            total = max((hi for _, hi, _ in self._offsets.values()), default=0)
            mask = torch.zeros(tokens, total, dtype=like.dtype)
            for name, start, end in current.spans:
                cols = self._offsets.get(name)
                if cols is not None:
                    mask[start:end, cols[0] : cols[1]] = cols[2]
            mask = mask.to(like.device)
            current.masks[tokens] = mask
        return mask

    def _hook(self, module: str) -> Callable[..., torch.Tensor | None]:
        def hook(
            _: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor
        ) -> torch.Tensor | None:
            current = self._pass
            stacked = self._stacked.get(module)
            if current is None or stacked is None:
                return None  # a pass of the base alone: the layer as it is
            x = args[0]
            a_t, b_t = stacked
            rows = x.reshape(-1, x.shape[-1])
            h = rows @ a_t  # every resident adapter's down-projection, [tokens, R]
            h.mul_(self._mask(current, rows.shape[0], x))  # each token keeps its adapter's
            if out.is_contiguous():  # in place: no [tokens, out] temporary per layer
                out.view(-1, out.shape[-1]).addmm_(h, b_t)
                return None
            return out + (h @ b_t).view(out.shape)

        return hook
