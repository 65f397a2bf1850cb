"""`twinfer chat`: the Textual chat app.

    app.py           ChatApp: layout, key bindings, loading, streaming replies, actions
    backend.py       ChatBackend (the app's only view of a model), EngineBackend over AsyncEngine, load + plan
    prompt.py        a conversation -> prompt tokens and stop strings (chat template or transcript)
    conversation.py  messages, settings, and the JSON conversation store
    widgets.py       input box, message view, loading panel, status panel
    dialogs.py       settings and open-conversation dialogs
    screenshot.py    regenerates docs/tui.svg
"""
