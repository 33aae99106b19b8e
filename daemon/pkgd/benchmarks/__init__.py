"""Library code of ``pkgd bench``: workloads, machine ceilings, baselines. Prints figures;
never asserts on timings."""
