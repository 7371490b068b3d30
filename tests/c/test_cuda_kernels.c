/* SPDX-License-Identifier: Apache-2.0
 *
 * test_cuda_kernels.c - tests/gpu/kernel_check.c without a GPU: the CUDA device layer, the
 * executor (canonical kernel choice, alignment checks, events, overlapping copies, gates,
 * order_after) and the kernels of csrc/cuda/kernels.cu compiled for the host, run through the
 * fake driver (fake_cuda.cc, loaded with $XCCL_CUDA_LIB) and compared bit for bit against the
 * CPU kernels. The Makefile builds the fake driver (FAKE_CUDA_LIB) and links fake_fatbin.c.
 */
#ifdef XCCL_HAVE_CUDA
#include <stdlib.h>

#define main kernel_check_main
#include "../gpu/kernel_check.c"
#undef main

int main(void)
{
    setenv("XCCL_CUDA_LIB", FAKE_CUDA_LIB, 1);
    return kernel_check_main();
}
#else
#include <stdio.h>

int main(void)
{
    printf("test_cuda_kernels: skipped (built without the CUDA headers)\n");
    return 0;
}
#endif
