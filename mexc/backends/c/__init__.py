"""target="c": plain C99 for FPU-less MCUs (`emit`), built on the host (`host`) or exported as a
project (`project`) with the runtime sources of `runtime/`."""
