"""astream.kvcache"""
