"""ACP-SGD: PowerSGD's low-rank compression with one collective per step instead of two.

PowerSGD (``powersgd``) runs one step of power iteration per training step: P = M Q, sum P over
the ranks, orthogonalize it to P^, Q = M^T P^, sum Q, and M ~ P^ Q^T: two collectives in a
row, the second waiting on the first. ACP-SGD (Zhang et al., "Evaluation and Optimization of
Gradient Compression for Distributed Deep Learning", ICDCS 2023) alternates the two halves
over the training steps, each step reusing the other factor of the step before:

    even step:  Q^ = orth(Q_prev);  P = M Q^;    sum P over ranks;  M ~ P_sum Q^^T
    odd step:   P^ = orth(P_prev);  Q = M^T P^;  sum Q over ranks;  M ~ P^ Q_sum^T

where M is the gradient plus this rank's error-feedback residual and the kept factors are the
previous step's *sums* (the same on every rank: the low-rank strategy adds the ranks' payloads
in rank order). Each step is a projection of M on a rank-r subspace that the alternation
refines from step to step, as PowerSGD's warm-started Q is. The residual is M minus this rank's
own projection (PowerSGD's error feedback: e = M - P^ Q_local^T). One collective per step of
r x rows or r x cols floats instead of both.

Pure torch (matrix products and a QR of the rank-r factor); synchronized by the low-rank strategy
(``lowrank``, one round). Payload: a 24-byte header (magic, kind, rows, cols, rank, floats),
then float32 factors. Kind 0 is a P (even step), 1 a Q (odd step): these decode only through
``finish`` with the state that holds the other factor. Kind 2 is what ``encode`` returns in a
single process: the fixed factor and the computed one, self-contained for ``decode``.
"""
from __future__ import annotations

from typing import Optional

import torch

from hipress.compression.base import Compressor, CompressorState, check_payload, check_residual_in, flat_f32, out_buffer
from hipress.compression.reference import acpsgd_first_q

_MAGIC = 0x31504341  # "ACP1"
_HEADER_INTS = 6
_HEADER = 4 * _HEADER_INTS
_P, _Q, _BOTH = 0, 1, 2


def _orthonormal(a: torch.Tensor) -> torch.Tensor:
    """The rank-r factor's columns made orthonormal by a Householder QR. Not Gram-Schmidt: a factor
    of lower rank than r (a gradient of rank 2 at rank 3) leaves a column of rounding noise that
    Gram-Schmidt normalizes without making it orthogonal to the others (a cross term of 0.08
    against 1e-16 here). Every rank holds the same summed factor, so every rank gets the same basis."""
    return torch.linalg.qr(a, mode="reduced")[0]


class ACPSGD(Compressor):
    """ACP-SGD (see the module docstring), with error feedback. Rank 32 by default: at rank 16,
    the bytes per step of ``powersgd`` at its rank 8 (one factor of 16 columns per step against
    both factors of 8), the char LM ended 13% above uncompressed perplexity; rank 32 (twice those
    bytes, in one collective instead of two) meets both accuracy targets (docs/convergence.md,
    "ACP-SGD")."""

    name = "acpsgd"
    category = "lowrank"
    aggregatable = True
    rounds = 1
    takes_residual_in = True  # encode_round reads the residual once, into M, before writing the new one

    def __init__(self, rank: int = 32, seed: int = 0, error_feedback: bool = True):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"acpsgd rank must be a positive int, got {rank!r}")
        self.rank, self.seed, self.error_feedback = rank, int(seed), bool(error_feedback)
        self.params = {"rank": rank, "seed": self.seed, "error_feedback": 1.0 if error_feedback else 0.0}
        # nominal: one factor of a square matrix per step, r x n of n x n floats (n = 1024)
        self.rate = rank / 1024

    @staticmethod
    def _matrix(numel: int, shape):
        numel = int(numel)
        if shape is None or len(shape) < 2 or numel == 0:
            return (numel, 1 if numel else 0)
        return (int(shape[0]), numel // int(shape[0]))

    def _r(self, rows: int, cols: int) -> int:
        return min(self.rank, rows, cols)

    def max_encoded_bytes(self, numel: int, shape=None) -> int:
        rows, cols = self._matrix(numel, shape)
        return _HEADER + 4 * self._r(rows, cols) * (rows + cols)

    def new_state(self, numel: int, shape=None) -> CompressorState:
        rows, cols = self._matrix(numel, shape)
        r = self._r(rows, cols)
        st = CompressorState(self.name, numel, shape,
                             {"residual": numel if self.error_feedback else 0, "p": rows * r, "q": cols * r},
                             matrix=(rows, cols))
        st.buffers["q"].copy_(torch.from_numpy(acpsgd_first_q(self.seed, rows, cols, r)).reshape(-1))
        return st

    # ---------------------------------------------------------------- payloads
    def _payload(self, kind: int, rows: int, cols: int, r: int, parts, out) -> torch.Tensor:
        nfloats = sum(p.numel() for p in parts)
        buf = out_buffer(out, _HEADER + 4 * nfloats)
        head = torch.tensor([_MAGIC, kind, rows, cols, r, nfloats], dtype=torch.int32)
        buf[:_HEADER].copy_(head.view(torch.uint8))
        body = buf[_HEADER:_HEADER + 4 * nfloats].view(torch.float32)
        off = 0
        for p in parts:
            body[off:off + p.numel()].copy_(p.reshape(-1))
            off += p.numel()
        return buf[:_HEADER + 4 * nfloats]

    def _parse(self, payload: torch.Tensor):
        p = check_payload(payload)
        if p.numel() < _HEADER:
            raise ValueError(f"acpsgd payload of {p.numel()} bytes is shorter than its {_HEADER}-byte header")
        magic, kind, rows, cols, r, nfloats = p[:_HEADER].clone().view(torch.int32).tolist()
        if magic != _MAGIC:
            raise ValueError("not an acpsgd payload (bad magic)")
        if kind not in (_P, _Q, _BOTH) or min(rows, cols, r, nfloats) < 0 or r > min(rows, cols):
            raise ValueError(f"corrupt acpsgd header: kind {kind}, {rows}x{cols}, rank {r}")
        want = {_P: rows * r, _Q: cols * r, _BOTH: (rows + cols) * r}[kind]
        if nfloats != want or p.numel() != _HEADER + 4 * nfloats:
            raise ValueError(f"acpsgd payload holds {p.numel() - _HEADER} bytes of factors, its header says "
                             f"{4 * nfloats} ({4 * want} for kind {kind} of {rows}x{cols} at rank {r})")
        return kind, rows, cols, r, p[_HEADER:].clone().view(torch.float32)

    def _check_state(self, state: Optional[CompressorState], what: str) -> CompressorState:
        if state is None:
            raise ValueError(f"acpsgd {what} needs a state (new_state(numel, shape))")
        if state.algorithm != self.name:
            raise ValueError(f"acpsgd {what}: a state of {state.algorithm!r}")
        return state

    # ---------------------------------------------------------------- low-rank protocol
    def encode_round(self, round: int, inp: torch.Tensor, state: CompressorState,
                     out: Optional[torch.Tensor] = None, residual_in: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This step's factor of M = gradient + residual: P = M orth(Q) on even steps, Q = M^T
        orth(P) on odd ones; the residual becomes M minus this rank's own projection. residual_in:
        the residual before this step, where it is not the state's buffer (which then only receives
        the new one; Compressor.takes_residual_in)."""
        st = self._check_state(state, "encode_round")
        if round != 0:
            raise ValueError(f"acpsgd has one round per step, got round {round}")
        g = flat_f32(inp)
        if g.numel() != st.numel:
            raise ValueError(f"state was made for {st.numel} elements, the gradient has {g.numel()}")
        rows, cols = st.matrix
        r = self._r(rows, cols)
        m = g.view(rows, cols)
        res = st.buffers["residual"]
        old = res if check_residual_in(residual_in, st, "residual") is None else residual_in
        if self.error_feedback:
            m = m + old.view(rows, cols)
        p, q = st.buffers["p"].view(rows, r), st.buffers["q"].view(cols, r)
        kind = st.step % 2
        if kind == _P:
            q.copy_(_orthonormal(q))
            local = m @ q
            if self.error_feedback:  # residual = M - local Q^T, in one fused product
                torch.addmm(m, local, q.T, alpha=-1, out=res.view(rows, cols))
        else:
            p.copy_(_orthonormal(p))
            local = m.T @ p
            if self.error_feedback:
                torch.addmm(m, p, local.T, alpha=-1, out=res.view(rows, cols))
        return self._payload(kind, rows, cols, r, [local], out)

    def scale_sum(self, payload: torch.Tensor, factor: float) -> bool:
        """The summed factor's floats, in place: finish's product is linear in them, and the next
        step orthonormalizes the factor it keeps, whatever its scale."""
        kind = self._parse(payload)[0]
        if kind == _BOTH:
            raise ValueError("acpsgd scale_sum takes a step's summed factor (kind P or Q), not encode's")
        check_payload(payload)[_HEADER:].view(torch.float32).mul_(factor)
        return True

    def combine(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        ka, ra, ca, rka, fa = self._parse(a)
        kb, rb, cb, rkb, fb = self._parse(b)
        if (ka, ra, ca, rka) != (kb, rb, cb, rkb) or ka == _BOTH:
            raise ValueError(f"acpsgd combines payloads of one step and matrix: kind {ka}/{kb}, "
                             f"{ra}x{ca}/{rb}x{cb}, rank {rka}/{rkb}")
        return self._payload(ka, ra, ca, rka, [fa + fb], out)

    def finish(self, payload: torch.Tensor, state: CompressorState, out: torch.Tensor,
               add: bool = False) -> torch.Tensor:
        """out (+)= the sum's projection: P_sum orth(Q)^T or orth(P) Q_sum^T (a SUM over the
        ranks, as PowerSGD's finish); the sum is kept as the factor the next step reuses."""
        st = self._check_state(state, "finish")
        kind, rows, cols, r, f = self._parse(payload)
        if (rows, cols) != tuple(st.matrix) or r != self._r(rows, cols):
            raise ValueError(f"acpsgd payload of a {rows}x{cols} matrix at rank {r}; the state holds "
                             f"{st.matrix[0]}x{st.matrix[1]}")
        if kind != st.step % 2:
            raise ValueError(f"acpsgd payload of kind {kind} at step {st.step}: the ranks are out of step")
        p, q = st.buffers["p"].view(rows, r), st.buffers["q"].view(cols, r)
        if kind == _P:
            p.copy_(f.view(rows, r))
        else:
            q.copy_(f.view(cols, r))
        st.scalars[1] += 1
        target = out.view(-1)
        if add:
            target.add_((p @ q.T).reshape(-1).to(out.dtype))
        elif out.dtype == torch.float32 and out.is_contiguous():  # the product straight into out
            torch.mm(p, q.T, out=target.view(rows, cols))
        else:
            target.copy_((p @ q.T).reshape(-1))
        return out

    # ---------------------------------------------------------------- single process
    def encode(self, grad: torch.Tensor, state: Optional[CompressorState] = None,
               out: Optional[torch.Tensor] = None, residual_in: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One step alone (a world of one rank): the factor and the one it is paired with, so that
        ``decode`` needs no state. With a state, the state advances as in a 1-rank sync."""
        check_residual_in(residual_in, state, "residual")
        st = state if state is not None else self.new_state(grad.numel(), tuple(grad.shape))
        st = self._check_state(st, "encode")
        own = self.encode_round(0, grad, st, residual_in=residual_in)
        rows, cols = st.matrix
        r = self._r(rows, cols)
        self.finish(own, st, torch.empty(st.numel, dtype=torch.float32))
        return self._payload(_BOTH, rows, cols, r, [st.buffers["p"], st.buffers["q"]], out)

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        kind, rows, cols, r, f = self._parse(payload)
        if kind != _BOTH:
            raise ValueError("an acpsgd P or Q payload decodes only with the state holding the other factor "
                             "(finish(payload, state, out))")
        if out.numel() != rows * cols:
            raise ValueError(f"out has {out.numel()} elements, the payload {rows * cols}")
        p, q = f[:rows * r].view(rows, r), f[rows * r:].view(cols, r)
        out.view(-1).copy_((p @ q.T).reshape(-1))
        return out

    def __repr__(self):
        return f"ACPSGD(rank={self.rank}, error_feedback={self.error_feedback})"
