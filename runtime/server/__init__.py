"""OpenAI-compatible HTTP server over the engine: app (endpoints), protocol (request models),
errors, chat_template, dsml (tool-call parser), detokenizer, output (response builder), corrupt
(the tool-json-corrupt fault), bridge (engine thread), metrics."""
