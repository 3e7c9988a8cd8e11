"""What a run tells people: MLflow tracking, console lines and Prefect artifacts, progress. May import
the contracts, `stepgrpo.images` and storage; nothing that computes."""
