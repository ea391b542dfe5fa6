"""Models on disk: repositories and the records of which version is live (repository), what a model file
holds (model_files), `inferd convert` (convert), and which outputs of a padded model are cut back (unpad)."""
