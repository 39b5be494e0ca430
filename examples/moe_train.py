"""A tiny MoE transformer trained with EP-MP x EP-DP x DP (and PP) on any torch.distributed
backend, checkpointed with olmo_chunks and resumed on another layout.

What the checkpoint sees is what a large run has: FP32 main weights, FP32 Adam moments and
per-parameter step counters, dense tensors as DTensors sharded over the stage's DP ranks, expert
tensors as flat storages split over EP-MP (experts) and EP-DP (flat shards), each stage saving its
own layers under global names, plus optimizer bookkeeping (recent losses and grad norms) and the
trainer state. Compute runs in BF16 on weights rebuilt with `olmo_chunks.compute_weights`.

Ranks: `rank = stage * S + m * ep_dp + d` with `S = ep_mp * ep_dp` ranks per stage; tokens are
data-parallel over the S ranks of a stage; routed tokens reach their experts by an all-gather over
EP-MP and come back by an all-reduce (the "allgather" token dispatcher). Pipeline stages run one
after another (no micro-batch schedule): activations go forward and gradients back by send/recv.

Run: `torchrun --nproc-per-node 4 examples/moe_train.py --layout 1,2,2 --steps 4 --save /tmp/ck`
then `torchrun --nproc-per-node 2 examples/moe_train.py --layout 1,1,2 --resume /tmp/ck --steps 2`.
"""

from __future__ import annotations

import argparse
import math
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

import olmo_chunks as oc
import torch
import torch.distributed as dist
import torch.nn.functional as F
from olmo_chunks.experts import ExpertLayout, chunk_range
from olmo_chunks.trainer_state import TrainerState, load_trainer_state
from olmo_chunks.weights import dtensor_weight, expert_weight
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

__all__ = ["Layout", "ModelConfig", "Trainer", "global_state", "main"]


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 64
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 4
    num_experts: int = 4
    top_k: int = 2
    d_expert: int = 32
    seq_len: int = 8
    global_batch: int = 8
    lr: float = 1e-2
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    router_jitter: float = 0.01
    window: int = 4
    seed: int = 1234


@dataclass(frozen=True)
class Layout:
    """Parallel degrees; the world size is their product."""

    pp: int = 1
    ep_mp: int = 1
    ep_dp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.ep_mp * self.ep_dp

    @property
    def stage_size(self) -> int:
        return self.ep_mp * self.ep_dp


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Every parameter: global shape and whether it is an expert tensor, in a fixed order."""
    d, e, h = cfg.d_model, cfg.num_experts, cfg.d_expert
    out: dict[str, tuple[tuple[int, ...], bool]] = {"embed": ((cfg.vocab, d), False)}
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}."
        out[p + "attn_norm"] = ((d,), False)
        out[p + "wqkv"] = ((3 * d, d), False)
        out[p + "wo"] = ((d, d), False)
        out[p + "mlp_norm"] = ((d,), False)
        out[p + "router"] = ((e, d), False)
        out[p + "experts.w_in"] = ((e, d, h), True)
        out[p + "experts.w_out"] = ((e, h, d), True)
    out["final_norm"] = ((d,), False)
    out["lm_head"] = ((cfg.vocab, d), False)
    return out


def initial_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The full FP32 initial weights, the same on every rank and layout."""
    gen = torch.Generator().manual_seed(cfg.seed)
    out = {}
    for name, (shape, _) in param_shapes(cfg).items():
        if name.endswith("norm"):
            out[name] = torch.ones(shape)
        else:
            out[name] = torch.randn(shape, generator=gen) * (1.0 / math.sqrt(shape[-1]))
    return out


def batch(cfg: ModelConfig, step: int) -> torch.Tensor:
    """Global batch `step`: arithmetic sequences mod vocab, `[global_batch, seq_len + 1]`."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    start = torch.randint(0, cfg.vocab, (cfg.global_batch, 1), generator=gen)
    stride = torch.randint(1, 5, (cfg.global_batch, 1), generator=gen)
    return (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab


_MESHES: dict[Layout, tuple[DeviceMesh, DeviceMesh]] = {}


def meshes(layout: Layout) -> tuple[DeviceMesh, DeviceMesh]:
    """(dense mesh ("pp", "dp"), expert mesh ("pp", "ep_mp", "ep_dp")) over the world, made once."""
    if layout not in _MESHES:
        dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
        dense = init_device_mesh(dev, (layout.pp, layout.stage_size), mesh_dim_names=("pp", "dp"))
        experts = init_device_mesh(dev, (layout.pp, layout.ep_mp, layout.ep_dp),
                                   mesh_dim_names=("pp", "ep_mp", "ep_dp"))
        _MESHES[layout] = (dense, experts)
    return _MESHES[layout]


def _chunk0(t: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    start, stop = chunk_range(t.shape[0], parts, index)
    return t[start:stop]


class _GatherTokens(torch.autograd.Function):
    """All-gather rows over a group; the gradient is all-reduced and sliced back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.n, ctx.rank = group, x.shape[0], dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None


class _ReduceTokens(torch.autograd.Function):
    """All-reduce rows over a group and keep this rank's; the gradient is all-gathered."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        size = dist.get_world_size(group)
        ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), y.shape[0] // size
        y = y.clone()
        dist.all_reduce(y, group=group)
        return y[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


def _nan(t: torch.Tensor) -> torch.Tensor:
    """Storage to be loaded into: NaN, so anything a load misses shows."""
    return t.fill_(float("nan"))


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


class Trainer:
    """One rank's share of the model and optimizer for `layout` (collective to construct)."""

    def __init__(self, cfg: ModelConfig, layout: Layout, *, init: bool = True) -> None:
        if dist.get_world_size() != layout.world_size:
            raise ValueError(f"{layout} needs {layout.world_size} ranks, not {dist.get_world_size()}")
        self.cfg, self.layout = cfg, layout
        self.rank = dist.get_rank()
        self.stage, i = divmod(self.rank, layout.stage_size)
        self.dp_rank = i
        self.ep_mp_rank, self.ep_dp_rank = divmod(i, layout.ep_dp)
        dense_mesh, expert_mesh = meshes(layout)
        self.dp_mesh = dense_mesh["dp"]
        self.ep_mp_group = expert_mesh.get_group("ep_mp")
        self.ep_dp_group = expert_mesh.get_group("ep_dp")
        self.layers = range(*chunk_range(cfg.n_layers, layout.pp, self.stage))
        full = initial_weights(cfg) if init else None

        def fresh(like: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(like) if init else _nan(torch.empty_like(like))

        self.params: dict[str, dict[str, Any]] = {}
        for name, (shape, is_expert) in param_shapes(cfg).items():
            if not self._owns(name):
                continue
            if is_expert:
                lo = ExpertLayout(cfg.num_experts, shape[1:], self.ep_mp_rank, layout.ep_mp, self.ep_dp_rank,
                                  layout.ep_dp, sharded=True)
                start, n = lo.flat_range
                main = full[name].reshape(-1)[start : start + n].clone() if full else _nan(lo.empty())
                p = {"layout": lo, "main": main}
                p["exp_avg"], p["exp_avg_sq"] = fresh(main), fresh(main)
            else:
                start, stop = chunk_range(shape[0], layout.stage_size, i)
                local = full[name][start:stop].clone() if full else _nan(torch.empty(stop - start,
                                                                                     *shape[1:]))
                p = {"main": self._dtensor(local, shape)}
                for moment in ("exp_avg", "exp_avg_sq"):
                    p[moment] = self._dtensor(fresh(local), shape)
            p["step"] = torch.zeros(()) if full else _nan(torch.empty(()))
            self.params[name] = p
        self.bookkeeping = {"recent_losses": torch.zeros(cfg.window), "grad_norms": torch.zeros(cfg.window)}
        self.state = TrainerState(seed=cfg.seed, config={"model": asdict(cfg)},
                                  data_manifest=[{"name": "arithmetic-sequences", "seed": cfg.seed}],
                                  data_position={"batches_processed": 0, "tokens_processed": 0})
        if init:
            torch.manual_seed(cfg.seed + self.rank)

    def _owns(self, name: str) -> bool:
        if name == "embed":
            return self.stage == 0
        if name in ("final_norm", "lm_head"):
            return self.stage == self.layout.pp - 1
        return int(name.split(".")[1]) in self.layers

    def _dtensor(self, local: torch.Tensor, shape: tuple[int, ...]) -> DTensor:
        stride = tuple(math.prod(shape[k + 1 :]) for k in range(len(shape)))
        return DTensor.from_local(local, self.dp_mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=stride)

    # ---- checkpoint ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and bookkeeping under global names (no trainer state)."""
        model, optim = {}, {}
        for name, p in self.params.items():
            if "layout" in p:
                lo = p["layout"]
                model[name] = lo.view(p["main"])
                optim[name] = {"exp_avg": lo.view(p["exp_avg"]), "exp_avg_sq": lo.view(p["exp_avg_sq"]),
                               "step": p["step"]}
            else:
                model[name] = p["main"]
                optim[name] = {"exp_avg": p["exp_avg"], "exp_avg_sq": p["exp_avg_sq"], "step": p["step"]}
        optim["bookkeeping"] = self.bookkeeping
        return {"model": model, "optim": optim}

    def layout_info(self) -> dict[str, int]:
        return {"pp": self.layout.pp, "ep_mp": self.layout.ep_mp, "ep_dp": self.layout.ep_dp}

    def save(self, path: str) -> None:
        oc.save({**self.state_dict(), **self.state.state_dict(layout=self.layout_info())}, path,
                info={"layout": self.layout_info()}, overwrite=True)

    def save_async(self, path: str) -> Future[None]:
        """Starts a save of the state as it is now; training may go on at once (the next step
        overwrites the optimizer storage the expert flat views alias: the save holds this step's)."""
        return oc.async_save({**self.state_dict(), **self.state.state_dict(layout=self.layout_info())}, path,
                             info={"layout": self.layout_info()}, overwrite=True)

    def load(self, path: str) -> str:
        """Restores everything this rank owns from `path`; returns the RNG outcome."""
        oc.load(self.state_dict(), path, partial=True)
        resumed = load_trainer_state(path, layout=self.layout_info())
        self.state = resumed.state
        return resumed.rng

    # ---- training --------------------------------------------------------------------------------

    def _compute_weights(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.params.items():
            if "layout" in p:
                w = expert_weight(p["layout"].view(p["main"]), self.ep_dp_group)
            else:
                w = dtensor_weight(p["main"])
            out[name] = w.requires_grad_()
        return out

    def _moe(self, x: torch.Tensor, w: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
        cfg = self.cfg
        p = f"layers.{layer}."
        flat = x.reshape(-1, cfg.d_model)
        logits = (flat @ w[p + "router"].t()).float()
        logits = logits * (1 + torch.empty_like(logits).uniform_(-cfg.router_jitter, cfg.router_jitter))
        top_v, top_i = logits.softmax(-1).topk(cfg.top_k, dim=-1)
        top_v = top_v / top_v.sum(-1, keepdim=True)
        if self.layout.ep_mp > 1:
            all_x = _GatherTokens.apply(flat, self.ep_mp_group)
            all_v = _GatherTokens.apply(top_v, self.ep_mp_group)
            parts = [torch.empty_like(top_i) for _ in range(self.layout.ep_mp)]
            dist.all_gather(parts, top_i, group=self.ep_mp_group)
            all_i = torch.cat(parts)
        else:
            all_x, all_v, all_i = flat, top_v, top_i
        out = torch.zeros(all_x.shape, dtype=torch.float32)
        w_in, w_out = w[p + "experts.w_in"], w[p + "experts.w_out"]
        first = self.params[p + "experts.w_in"]["layout"].expert_range[0]
        for e in range(w_in.shape[0]):
            rows, slots = (all_i == first + e).nonzero(as_tuple=True)
            if rows.numel():
                y = F.silu(all_x[rows] @ w_in[e]) @ w_out[e]
                out = out.index_add(0, rows, y.float() * all_v[rows, slots].unsqueeze(-1))
        if self.layout.ep_mp > 1:
            out = _ReduceTokens.apply(out, self.ep_mp_group)
        return out.to(x.dtype).reshape(x.shape)

    def _block(self, h: torch.Tensor, w: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
        cfg = self.cfg
        p = f"layers.{layer}."
        b, t, d = h.shape
        qkv = _rms(h, w[p + "attn_norm"]) @ w[p + "wqkv"].t()
        q, k, v = (z.reshape(b, t, cfg.n_heads, d // cfg.n_heads).transpose(1, 2) for z in qkv.split(d, -1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        h = h + o @ w[p + "wo"].t()
        return h + self._moe(_rms(h, w[p + "mlp_norm"]), w, layer)

    def train_step(self) -> float:
        """One optimizer step on global batch `state.step`; returns the global mean loss."""
        cfg, lay = self.cfg, self.layout
        w = self._compute_weights()
        tokens = _chunk0(batch(cfg, self.state.step), lay.stage_size, self.dp_rank)
        x, y = tokens[:, :-1], tokens[:, 1:]
        shape = (x.shape[0], x.shape[1], cfg.d_model)
        prev, nxt = self.rank - lay.stage_size, self.rank + lay.stage_size
        if self.stage == 0:
            h_in = None
            h = w["embed"][x]
        else:
            h_in = torch.empty(shape, dtype=torch.bfloat16)
            dist.recv(h_in, prev)
            h = h_in.requires_grad_()
        for layer in self.layers:
            h = self._block(h, w, layer)
        loss = torch.zeros(())
        if self.stage == lay.pp - 1:
            logits = (_rms(h, w["final_norm"]) @ w["lm_head"].t()).float()
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1))
            loss.backward()
        else:
            dist.send(h.detach().contiguous(), nxt)
            grad = torch.empty(shape, dtype=torch.bfloat16)
            dist.recv(grad, nxt)
            h.backward(grad)
        if h_in is not None:
            dist.send(h_in.grad.contiguous(), prev)
        norm_sq = self._reduce_and_step(w)
        stats = torch.stack([loss.detach().float(), norm_sq])
        dist.all_reduce(stats)
        mean_loss = stats[0] / lay.stage_size
        for key, value in (("recent_losses", mean_loss[None]), ("grad_norms", stats[1:].sqrt())):
            window = self.bookkeeping[key]
            window.copy_(torch.cat([window[1:], value]))
        st = self.state
        st.step += 1
        st.tokens += cfg.global_batch * cfg.seq_len
        st.data_position = {"batches_processed": st.step, "tokens_processed": st.tokens}
        return float(mean_loss)

    def _reduce_and_step(self, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """Averages gradients over the stage's data-parallel ranks, keeps this rank's shard, runs
        Adam on the FP32 storages; returns this rank's share of the squared global grad norm."""
        cfg, lay = self.cfg, self.layout
        norm_sq = torch.zeros(())
        for name, p in self.params.items():
            g = w[name].grad
            g = torch.zeros(w[name].shape) if g is None else g.float()
            if "layout" in p:
                lo = p["layout"]
                dist.all_reduce(g, group=self.ep_dp_group)
                start, stop = lo.block_range()
                g = g.reshape(-1)[start:stop] / lay.stage_size
                main, m, v = p["main"], p["exp_avg"], p["exp_avg_sq"]
            else:
                dist.all_reduce(g, group=self.dp_mesh.get_group())
                g = _chunk0(g, lay.stage_size, self.dp_rank) / lay.stage_size
                main, m, v = p["main"].to_local(), p["exp_avg"].to_local(), p["exp_avg_sq"].to_local()
            norm_sq += g.pow(2).sum()
            p["step"] += 1
            t = float(p["step"])
            m.mul_(cfg.beta1).add_(g, alpha=1 - cfg.beta1)
            v.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
            denom = (v / (1 - cfg.beta2**t)).sqrt_().add_(cfg.eps)
            main.addcdiv_(m, denom, value=-cfg.lr / (1 - cfg.beta1**t))
        return norm_sq


def global_state(trainer: Trainer) -> dict[str, torch.Tensor] | None:
    """Every saved tensor as a full FP32 global tensor (on rank 0; None elsewhere), for checks."""
    mine: dict[str, Any] = {}
    for name, p in trainer.params.items():
        for part in ("main", "exp_avg", "exp_avg_sq"):
            if "layout" in p:
                lo = p["layout"]
                full = expert_weight(lo.view(p[part]), trainer.ep_dp_group, torch.float32)
                if lo.ep_dp_rank == 0:
                    mine[f"{name}.{part}"] = (lo.expert_range[0], full)
            else:
                full = dtensor_weight(p[part], torch.float32)
                if trainer.dp_rank == 0:
                    mine[f"{name}.{part}"] = (None, full)
        if trainer.dp_rank == 0:
            mine[f"{name}.step"] = (None, p["step"].clone())
    if trainer.rank == 0:
        for k, v in trainer.bookkeeping.items():
            mine[f"bookkeeping.{k}"] = (None, v.clone())
    everything: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, mine)
    if trainer.rank != 0:
        return None
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    out = {}
    for rank_items in everything:
        for key, (first, t) in rank_items.items():
            if first is None:
                out[key] = t
            else:
                parts.setdefault(key, []).append((first, t))
    for key, blocks in parts.items():
        out[key] = torch.cat([t for _, t in sorted(blocks, key=lambda b: b[0])])
    return dict(sorted(out.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="1,1,1", help="pp,ep_mp,ep_dp")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--save", help="checkpoint directory to save to after training")
    ap.add_argument("--save-every", type=int, default=0,
                    help="also checkpoint asynchronously every N steps, to SAVE/stepN, while training goes on")
    ap.add_argument("--resume", help="checkpoint directory to resume from")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    layout = Layout(*map(int, args.layout.split(",")))
    trainer = Trainer(ModelConfig(), layout, init=args.resume is None)
    if args.resume:
        rng = trainer.load(args.resume)
        if trainer.rank == 0:
            print(f"resumed at step {trainer.state.step} on {layout} (RNG {rng})")
    pending = None
    for _ in range(args.steps):
        loss = trainer.train_step()
        if trainer.rank == 0:
            print(f"step {trainer.state.step}: loss {loss:.6f}")
        if args.save and args.save_every and trainer.state.step % args.save_every == 0:
            pending = trainer.save_async(f"{args.save}/step{trainer.state.step}")  # waits for the last one
    if pending is not None:
        pending.result()
    if args.save:
        trainer.save(args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
