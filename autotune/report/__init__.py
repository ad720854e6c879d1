"""What a search leaves: config.json and trials.csv (export), report.md/.html (render, from data,
summary, sections, plots and format), compare (compare_runs, compare_render)."""
