"""``python -m pkgd.runner.tp_worker``: a tensor-parallel worker (ranks 1..tp-1); see
`pkgd.runner.tp_executor`."""

from pkgd.runner.tp_executor import worker_main

if __name__ == "__main__":
    worker_main()
