"""Pipeline schedules: per step, the instructions one stage executes.

The schedules are DeepSpeed's (DeepSpeed 0.19.8's runtime/pipe/schedule.py): the same steps,
instructions and buffer indices, so a stage's order of work and of messages is the one
DeepSpeed's pipeline engine has.

- :class:`TrainSchedule`: synchronous 1F1B. ``2 · (micro_batches + stages − 1)`` steps; on even
  steps even stages run a forward and odd stages a backward (and the other way round on odd
  steps), so a stage starts its backwards as soon as the last stage has the first micro-batch
  and holds at most ``stages − stage_id`` activations. Within one step, adjacent stages name
  matching messages: a forward step sends the previous backward's input gradient back and
  receives this forward's input; a backward step receives the output gradient and sends the
  previous forward's output. The last step ends with the tied-gradient sum, the data-parallel
  reduction and the optimizer step.
- :class:`InferenceSchedule`: forwards only, ``micro_batches + stages − 1`` steps, two
  alternating buffers.

Every message of a step comes before the step's computation, so an engine may exchange the
whole step's messages at once (:func:`ds_core.comm.batch_isend_irecv`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "BackwardPass",
    "ForwardPass",
    "InferenceSchedule",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeInstruction",
    "PipeSchedule",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "SendActivation",
    "SendGrad",
    "TrainSchedule",
]


@dataclass(frozen=True)
class PipeInstruction:
    """One unit of a stage's work."""


@dataclass(frozen=True)
class BufferOpInstruction(PipeInstruction):
    """An instruction on one pipeline buffer (``buffer_id``: index into the stage's buffers)."""

    buffer_id: int


class LoadMicroBatch(BufferOpInstruction):
    """Read the next micro-batch: inputs on the first stage, labels on the last."""


class ForwardPass(BufferOpInstruction):
    """Run the stage's layers on the buffer's inputs (the last stage: and the loss)."""


class BackwardPass(BufferOpInstruction):
    """Back-propagate the buffer's loss (last stage) or its received output gradient."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's outputs to the next stage."""


class RecvActivation(BufferOpInstruction):
    """Receive the buffer's inputs from the previous stage."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of the buffer's inputs to the previous stage."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradient of the buffer's outputs from the next stage."""


class ReduceTiedGrads(PipeInstruction):
    """Sum tied weights' gradients over the stages holding them."""


class ReduceGrads(PipeInstruction):
    """Reduce gradients over the stage's data-parallel group."""


class OptimizerStep(PipeInstruction):
    """Update the parameters."""


class PipeSchedule(ABC):
    """The steps of one batch for ``stage_id`` of ``stages`` over ``micro_batches``.

    Iterating yields one list of instructions per step.

    :raises ValueError: when ``micro_batches`` or ``stages`` is below 1, or ``stage_id`` is
        not in ``[0, stages)``.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        if stages < 1:
            raise ValueError(f"stages must be >= 1, got {stages}")
        if not 0 <= stage_id < stages:
            raise ValueError(f"stage_id {stage_id} is outside [0, {stages})")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    @abstractmethod
    def steps(self) -> Iterator[list[PipeInstruction]]:
        """The instructions of each step, in order."""

    def num_pipe_buffers(self) -> int:
        """Buffers the stage needs (activations alive at once)."""
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        """Whether this is stage 0."""
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this is the last stage."""
        return self.stage_id == self.stages - 1

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        return micro_batch_id % self.num_pipe_buffers()

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()


class InferenceSchedule(PipeSchedule):
    """Forward passes only (``eval_batch``)."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """The instructions of each step, in order."""
        even = self.stage_id % 2 == 0
        for step_id in range(self.micro_batches + self.stages - 1):
            cmds: list[PipeInstruction] = []
            mb = step_id - self.stage_id
            recv_buf, send_buf = (step_id % 2, (step_id + 1) % 2)
            if not even:
                recv_buf, send_buf = send_buf, recv_buf
            if (self.is_first_stage or self.is_last_stage) and self._valid_micro_batch(mb):
                cmds.append(LoadMicroBatch(recv_buf))
            send = self._valid_stage(self.next_stage) and self._valid_micro_batch(mb - 1)
            recv = self._valid_stage(self.prev_stage) and self._valid_micro_batch(mb)
            if even:
                cmds += [SendActivation(send_buf)] if send else []
                cmds += [RecvActivation(recv_buf)] if recv else []
            else:
                cmds += [RecvActivation(recv_buf)] if recv else []
                cmds += [SendActivation(send_buf)] if send else []
            if self._valid_micro_batch(mb):
                cmds.append(ForwardPass(recv_buf))
            yield cmds

    def num_pipe_buffers(self) -> int:
        """Two: one being received into while the other is sent."""
        return 2


class TrainSchedule(PipeSchedule):
    """Synchronous 1F1B training over ``micro_batches`` (= gradient accumulation steps)."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """The instructions of each step, in order."""
        prev_mb = -1
        total = 2 * (self.micro_batches + self.stages - 1)
        for step_id in range(total):
            mb, forward = self._step_to_micro_batch(step_id)
            cmds: list[PipeInstruction] = []
            prev_ok, cur_ok = self._valid_micro_batch(prev_mb), self._valid_micro_batch(mb)
            prev_buf = self._buffer_idx(prev_mb) if prev_ok else -1
            cur_buf = self._buffer_idx(mb) if cur_ok else -1
            if forward:
                if prev_ok and self._valid_stage(self.prev_stage):
                    cmds.append(SendGrad(prev_buf))
                if cur_ok and self._valid_stage(self.prev_stage):
                    cmds.append(RecvActivation(cur_buf))
            else:
                if cur_ok and self._valid_stage(self.next_stage):
                    cmds.append(RecvGrad(cur_buf))
                if prev_ok and self._valid_stage(self.next_stage):
                    cmds.append(SendActivation(prev_buf))
            if (self.is_first_stage or self.is_last_stage) and forward and cur_ok:
                cmds.append(LoadMicroBatch(cur_buf))
            if cur_ok:
                cmds.append(ForwardPass(cur_buf) if forward else BackwardPass(cur_buf))
            if step_id == total - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            prev_mb = mb
            yield cmds

    def num_pipe_buffers(self) -> int:
        """Activations alive at once, DeepSpeed's rule: ``max(2, min(stages − stage_id,
        micro_batches))``."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def _step_to_micro_batch(self, step_id: int) -> tuple[int, bool]:
        """The micro-batch a step works on and whether it is a forward."""
        even_step, even_stage = step_id % 2 == 0, self.stage_id % 2 == 0
        if even_step == even_stage:  # forward
            base = step_id // 2 if even_step else (step_id - 1) // 2
            return base - self.stage_id // 2, True
        if even_step:  # odd stage, backward
            return step_id // 2 - self.stages + (self.stage_id + 1) // 2, False
        return (step_id - 1) // 2 - self.stages + 1 + self.stage_id // 2, False
