"""astream.models"""
