"""vLLM's `current_platform`, as a CPU platform."""


class _CpuPlatform:
    device_type = "cpu"

    def is_cuda(self):
        return False

    def is_rocm(self):
        return False

    def is_xpu(self):
        return False

    def is_cpu(self):
        return True


current_platform = _CpuPlatform()
