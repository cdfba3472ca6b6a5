// The first include of an instantiation whose tiles use a WGMMA N outside CuTe's default shapes
// (scripts/generate_kernels.py writes it there): CuTe's extended shapes of the dense instructions
// only. CuTe's one switch, CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, also declares the extended
// shapes of the sparse instructions, which these kernels never use and which are most of the
// switch's compile time; so it is on while the dense instruction headers are read and off after,
// and ss_gmma (gmma_shapes.hpp) names the extended instructions itself instead of asking CuTe's
// selector, whose extended cases need the switch.
#pragma once

#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#undef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED

#define FLASHHOPPER_EXTENDED_GMMA_SHAPES 1
