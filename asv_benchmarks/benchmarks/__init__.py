"""asv benchmarks of sdpa_array (see ``asv_benchmarks/asv.conf.json``)."""
