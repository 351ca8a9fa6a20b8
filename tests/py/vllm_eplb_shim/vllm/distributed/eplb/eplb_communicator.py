"""A stand-in for `vllm.distributed.eplb.eplb_communicator`: vLLM 0.34.0's `EplbCommunicator`
interface (the base class tests subclass), nothing of its backends."""

from abc import ABC, abstractmethod


class EplbCommunicator(ABC):
    """vLLM 0.34.0's abstract EPLB communicator: queue sends and receives, then execute."""

    @abstractmethod
    def add_send(self, tensors, dst_rank, expert_id):
        pass

    @abstractmethod
    def add_recv(self, tensors, src_rank, expert_id):
        pass

    @abstractmethod
    def execute(self):
        pass

    def set_transfer_context(self, old_indices, layer_idx, recv_rows=None):  # noqa: B027
        """No-op, as vLLM's base class."""

    @property
    def needs_recv_rows(self):
        return False

    @property
    def owned_expert_buffer(self):
        return None

    @property
    def needs_profile_buffer_reservation(self):
        return True

    def set_stream(self, stream):
        self._stream = stream
