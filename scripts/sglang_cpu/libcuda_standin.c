/* A stand-in for the CUDA driver library, for running SGLang's CPU engine on a machine with no
 * GPU driver at all (CI and the development machines of this project).
 *
 * sglang-kernel (SGLang's compiled kernel library) is built against CUDA and, when imported,
 * resolves exactly one driver symbol, cuPointerGetAttribute, from libcuda.so.1. With
 * SGLANG_USE_CPU_ENGINE=1 and device="cpu" nothing ever calls it: SGLang runs on plain torch.
 * Only the dynamic loader needs the symbol to exist. This library exports it and answers
 * CUDA_ERROR_NO_DEVICE (100) should anything call it, so a real GPU code path fails loudly
 * instead of misbehaving. It is built into the SGLang test environment only
 * (scripts/setup_sglang_env.sh) and never on a machine that has a GPU driver.
 */
int cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) {
    (void)data; (void)attribute; (void)ptr;
    return 100; /* CUDA_ERROR_NO_DEVICE */
}
