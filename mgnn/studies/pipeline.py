"""GPipe-style pipeline parallelism over the same layer blocks: the baseline that layer-parallel
MGRIT is compared with (exact gradients).

Each layer rank is a stage owning its block of layers. The batch is split into M micro-batches;
all forwards run first (micro-batch m enters stage r+1 while stage r works on m+1), then all
backwards in reverse stage order; parameter gradients are summed over the micro-batches.
"""
import time

import numpy as np

from ..comm import abort_on_error
from ..comm.halo import tag, wait_request
from ..network import LayerParallel


class PipelineParallel(LayerParallel):
    """Pipeline-parallel loss and gradient of ``model`` over the layer ranks of ``comm``.

    Parameters
    ----------
    model : Model
    comm : mpi4py communicator or None
    micro_batches : int
        M, the number of micro-batches each batch is split into (``numpy.array_split``).
    backend : {'numba', 'numpy'}
    data_ranks : int
        Data replicas, as in :class:`LayerParallel`.
    """

    def __init__(self, model, comm=None, micro_batches=1, backend="numba", data_ranks=1):
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or \
                micro_batches < 1:
            raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
        if not getattr(getattr(model, "step", None), "fused", True):
            # micro-batches would change batch-norm statistics: not the same network
            raise ValueError("the pipeline baseline runs fused step kinds only (no batch norm "
                             "or dropout: micro-batches would change the batch statistics)")
        super().__init__(model, comm=comm, backend=backend, data_ranks=data_ranks)
        self.micro_batches = micro_batches

    def loss_and_grad(self, x, y, out=None):
        """As :meth:`LayerParallel.loss_and_grad` (exact; ``stats['timings']`` filled; the
        gradient into ``out`` when given)."""
        x, y = self._validated(x, y, out)
        if x.shape[0] < self.micro_batches:
            raise ValueError(f"batch of {x.shape[0]} samples cannot be split into "
                             f"{self.micro_batches} micro-batches")
        with abort_on_error(self.layout.comm, "mgnn pipeline"):
            loss, grads = self._pipeline(x, y)
        if out is None:
            return loss, grads
        out.flat[...] = grads.flat
        return loss, out

    def _pipeline(self, x, y):
        t_start = time.perf_counter()
        m, bk, lay = self.model, self.bk, self.layout
        N = m.n_layers
        lo, hi = self.partition.fine_range(lay.layer_rank)
        stop = min(hi, N)
        steps = m.group("steps")
        W, b = steps["weight"][lo:stop], steps["bias"][lo:stop]
        comm = lay.layer_comm
        timings = {"steps": 0.0, "halo_wait": 0.0, "allreduce": 0.0}
        total_batch = x.shape[0] if lay.data_comm is None else lay.data_comm.allreduce(x.shape[0])
        parts = np.array_split(np.arange(x.shape[0]), self.micro_batches)
        grads = m.params.zeros_like()
        gW, gb = np.zeros_like(W), np.zeros_like(b)
        tmpW, tmpb = np.empty_like(W), np.empty_like(b)
        saved, sends, loss_part = [], [], 0.0

        def recv(shape, source, t):
            buf = np.empty(shape, dtype=m.dtype)
            t0 = time.perf_counter()
            wait_request(comm.Irecv(buf, source=source, tag=t))  # Ctrl-C is seen while waiting
            timings["halo_wait"] += time.perf_counter() - t0
            return buf

        for k, idx in enumerate(parts):  # all forwards
            shape = m.step.state_shape(len(idx))
            if not lay.first:
                u0, d_open = recv(shape, lay.layer_rank - 1, tag("chain")), None
            t0 = time.perf_counter()
            if lay.first:
                u0, d_open = m.opening.forward(m.group("opening"), x[idx], bk)
            U = np.empty((stop - lo + 1,) + shape, dtype=m.dtype)
            U[0] = u0
            D = np.empty((stop - lo,) + shape, dtype=m.dtype)
            m.step.sweep_forward(W, b, U, m.h, D, bk)
            timings["steps"] += time.perf_counter() - t0
            if not lay.last:
                sends.append(comm.Isend(U[-1], dest=lay.layer_rank + 1, tag=tag("chain")))
            saved.append((U, D, d_open))
        for k in range(len(parts) - 1, -1, -1):  # all backwards
            idx = parts[k]
            U, D, d_open = saved[k]
            if lay.last:
                t0 = time.perf_counter()
                logits, c_close = m.closing.forward(m.group("closing"), U[-1], bk)
                loss, g = m.loss.forward_grad(logits, y[idx], bk)
                loss_part += loss * len(idx) / total_batch
                g *= m.dtype.type(len(idx) / total_batch)
                lam, gc = m.closing.vjp(m.group("closing"), U[-1], c_close, g, bk)
                for name, v in gc.items():
                    grads[f"closing.{name}"] += v
                timings["steps"] += time.perf_counter() - t0
            else:
                lam = recv(U[-1].shape, lay.layer_rank + 1, tag("adjoint_halo"))
            t0 = time.perf_counter()
            lam = m.step.sweep_backward(W, b, U, D, m.h, lam, tmpW, tmpb, bk)
            gW += tmpW
            gb += tmpb
            if lay.first:
                _, go = m.opening.vjp(m.group("opening"), x[idx], d_open, lam, bk)
                for name, v in go.items():
                    grads[f"opening.{name}"] += v
            timings["steps"] += time.perf_counter() - t0
            if not lay.first:
                sends.append(comm.Isend(np.ascontiguousarray(lam), dest=lay.layer_rank - 1,
                                        tag=tag("adjoint_halo")))
        grads["steps.weight"][lo:stop] = gW
        grads["steps.bias"][lo:stop] = gb
        t0 = time.perf_counter()
        for s in sends:
            wait_request(s)
        if lay.data_comm is not None and lay.data_ranks > 1:
            from mpi4py import MPI
            lay.data_comm.Allreduce(MPI.IN_PLACE, grads.flat)
        loss = loss_part if lay.comm is None else lay.comm.allreduce(loss_part)
        timings["allreduce"] += time.perf_counter() - t0
        timings["total"] = time.perf_counter() - t_start
        timings["other"] = timings["total"] - timings["steps"] - timings["halo_wait"] \
            - timings["allreduce"]
        self.stats = {"timings": timings}
        return float(loss), grads
