"""Integrations with training frameworks, one module per framework, each imported only when asked for.

The rules stay framework-agnostic; what a framework needs in order to hand memopt its graphs (a model attribute
to set, a compile call in the right place) lives here. ``import fxpass`` imports none of the framework modules,
so it never imports the frameworks either; it only installs ``transformers_logging``'s hook, which waits for
transformers to be imported by the user.

    from fxpass.integrations.transformers import compile_model     # Hugging Face Trainer, TRL
"""
