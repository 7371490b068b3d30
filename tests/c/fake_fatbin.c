/* SPDX-License-Identifier: Apache-2.0
 *
 * fake_fatbin.c - stands in for the embedded GPU kernels (csrc/cuda/build_fatbin.py's output)
 * in tests that run the CUDA executor on the fake driver (fake_cuda.cc), which runs its own
 * host build of kernels.cu and only checks that the image starts with the fatbin magic.
 */
#include <stddef.h>

_Alignas(16) const unsigned char xccl_cuda_fatbin[16] = {0x50, 0xed, 0x55, 0xba};
const size_t xccl_cuda_fatbin_size                    = sizeof xccl_cuda_fatbin;
const char   xccl_cuda_archs[]                        = "host (fake driver)";
