"""Memory of a CUDA graph capture that the CPU can check: the warm-up call before a capture
copies only the caller's tensors it writes into."""
import torch

from kiln.runtime.cuda_graph import warm_up_inputs


def test_warm_up_copies_only_the_inputs_it_writes():
    """Before, the warm-up ran on copies of every input: capturing a training step's backward
    held a second copy of every value the forward saved (and the forward's capture one of every
    parameter) at the first step, the step of peak memory. Now the inputs read in place and the
    graph's own static buffers are used as they are; a caller's tensor written into (a KV cache)
    is still copied."""
    saved, cache, batch = torch.randn(1000), torch.zeros(10), torch.randn(4)
    inputs = warm_up_inputs([saved, cache, batch], written=[1])
    assert inputs[0] is saved and inputs[2] is batch
    assert inputs[1] is not cache and inputs[1].data_ptr() != cache.data_ptr()
    torch.testing.assert_close(inputs[1], cache)
    copied = sum(t.nbytes for t, s in zip(inputs, (saved, cache, batch)) if t is not s)
    assert copied == cache.nbytes
