"""``asyncfeed bench``: asyncfeed against DataLoader, torchdata.nodes and SPDL, head to head.

One module per job:

* :mod:`.workloads`: the data sets (JPEG folder, data set in RAM, GIL-bound transform)
  and the sample order every contender shares; :mod:`.remote`: the HTTP server of (e);
* :mod:`.contenders`: building each loader from ``(family, knob)``;
* :mod:`.server` / :mod:`.client`: a fork server, so every run is a fresh process;
* :mod:`.child`: one measured run (throughput, time to first batch, training step);
* :mod:`.measure`: memory (PSS over the process tree) and other load, from outside;
* :mod:`.limit`: the limit line (one process per core, no loader);
* :mod:`.config`: settings and configurations; :mod:`.runner`: planning, A B A B rounds;
* :mod:`.summary`: medians and ratios; :mod:`.machine`: what it ran on;
* :mod:`.tuning`: knees of the throughput curves;
* :mod:`.report` / :mod:`.plot`: the table, the JSON, the PNG.

The command line is :mod:`asyncfeed._bench.cli`.
"""
