# Warning flags for dtrain's own targets, here so that the examples can use them when they are
# built alone against an installed dtrain (examples/CMakeLists.txt).
set(DTRAIN_WARNINGS -Wall -Wextra)
# CI turns warnings in dtrain's own targets into errors (scripts/test.sh, scripts/ci-legs.sh).
# Dependencies' headers come in through imported targets as -isystem, so they do not count.
if(DTRAIN_WERROR)
  list(APPEND DTRAIN_WARNINGS -Werror)
endif()

# The test programs' own code (GoogleTest binaries, the test worker) compiles at -O1 where the
# build optimises: it is set-up and checks, while what it exercises (libdtrain, the examples'
# libraries, LibTorch) keeps the build's optimisation. -O3's inlining cost a third of each
# test file's compile time (GCC 12: 14.9 s -> 10.3 s for first_hour_test.cpp), twice in CI.
set(DTRAIN_TEST_OPTIONS ${DTRAIN_WARNINGS}
    $<$<OR:$<CONFIG:Release>,$<CONFIG:RelWithDebInfo>,$<CONFIG:MinSizeRel>>:-O1>)

# GCC 14 at -O2/-O3 reports a false -Warray-bounds ("forming offset 8 is out of the bounds
# [0, 8]") and -Wstringop-overflow ("writing between 9 and 9223372036854775807 bytes into a
# region of size 8") inside libstdc++'s vector<bool>::reserve, inlined through LibTorch 2.x's
# torch::autograd::Function<T>::apply (custom_function.h) into each file that calls apply.
# The inlining makes it count as ours although no line of ours indexes anything, and a
# pragma at the call site does not reach it, so those files (only) build without these two
# warnings on GCC 14 and later. Call from the directory that adds the files.
function(dtrain_no_false_array_bounds)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 14)
    set_property(SOURCE ${ARGN} APPEND PROPERTY COMPILE_OPTIONS
                 -Wno-array-bounds -Wno-stringop-overflow)
  endif()
endfunction()
