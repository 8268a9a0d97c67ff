"""The stages' entries: each module is one DVC stage (dvc.yaml stage = ``stages/<name>.py`` launcher = params
section = ``artifacts/<name>/``): load config, open inputs, call the library, write outputs."""
