"""OpenAI's Responses API (/v1/responses): wire shapes (wire.py), stored responses
(service.py); the routes are in routes/responses.py."""
