"""What a search leaves: config.json and trials.csv (export), report.md/.html (render), compare."""
