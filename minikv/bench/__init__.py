"""Measuring tools, to the side of the library: nothing under ``minikv`` imports them except the CLI.

equivalence  the one yardstick (rel_err, the DESIGN tolerances, assert_close)
corpus       a fixed English text that ships with every Python
machine      what machine a benchmark ran on, and writing its JSON
workloads    the synthetic batching workload, the contiguous baseline's policy, the batching benchmark
"""
