"""Measuring: the memory meter, metrics, plots, lesson tables, interleaved trials, the probes that
fit comm.cost, how busy the cores are, timelines as Chrome traces. Above the strategies it measures,
below the advisor and the apps."""
