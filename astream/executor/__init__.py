"""astream.executor"""
