#pragma once
// How partir's heavy entry points (the kernels, lowering, propagation rules, autodiff, the simulator) are
// compiled. Header-only, the default: every translation unit compiles the ones it calls (PARTIR_ENTRY is
// `inline`) and the linker keeps one copy. With PARTIR_SEPARATE_COMPILATION a translation unit sees their
// declarations only and libpartir (src/libpartir.cpp, built with PARTIR_COMPILING_LIBRARY) holds the one
// definition of each: link it (Meson: dependency('partir-compiled'); pkg-config: partir-compiled).
// PARTIR_DEFINE_ENTRIES says whether this translation unit compiles the bodies.
#if !defined(PARTIR_SEPARATE_COMPILATION)
#define PARTIR_ENTRY inline
#define PARTIR_DEFINE_ENTRIES 1
#elif defined(PARTIR_COMPILING_LIBRARY)
#define PARTIR_ENTRY
#define PARTIR_DEFINE_ENTRIES 1
#else
#define PARTIR_ENTRY
#define PARTIR_DEFINE_ENTRIES 0
#endif
