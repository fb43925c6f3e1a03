"""toolkit.models: model families and local pretrained folders."""
